"""Regenerate flux1_device_map.json (UI format) and api/flux1_device_map_api.json (API format).

    python example_workflows/make_flux1_device_map.py

Widget values of a UI workflow are positional: they must follow each node's INPUT_TYPES (required, then optional;
a seed with control_after_generate is followed by its "randomize"/"fixed" value). This script reads INPUT_TYPES
from the node classes, so the two files follow the nodes whenever they change; values not set below are the
widgets' defaults. tests/test_e2e_comfyui.py checks both files against a real server's /object_info.
The API copy lives in api/ because ComfyUI's template browser lists every example_workflows/*.json, and an
API-format file opened there loads as an empty graph.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from parallel_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

MODEL = "FLUX.1-dev"  # a folder name in ComfyUI/models/diffusers
PROMPT = ("a red fox in a knitted scarf reading a newspaper at a small cafe table, morning light through the "
          "window, shallow depth of field, 35mm photo")
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
PACK = {"cnr_id": "comfyui-parallel-diffusers", "ver": "0.1.0"}
CORE = {"cnr_id": "comfy-core", "ver": "0.3.75"}
SAVE_IMAGE = {  # ComfyUI's core SaveImage, as /object_info describes it
    "INPUT_TYPES": {"required": {"images": ("IMAGE", {}), "filename_prefix": ("STRING", {"default": "ComfyUI"})}},
    "RETURN_TYPES": (), "RETURN_NAMES": (), "title": "Save Image",
}

# id, class, position, size, widget values (the rest: defaults), sockets {input: (from node, output slot)}
NODES = [
    (1, "ParallelBackend", [40, 330], [300, 130], {"ranks": 0, "device": "auto", "memory_policy": "staged"}, {}),
    (2, "EncodeOnBalancedGPUs", [390, 60], [420, 400], {"model": MODEL, "prompt": PROMPT}, {"backend": (1, 0)}),
    (3, "LoadShardedTransformer", [390, 510], [420, 330], {"model": MODEL, "strategy": "device_map"},
     {"backend": (1, 0)}),
    (4, "ParallelSampler", [870, 230], [320, 262],
     {"seed": 42, "steps": 28, "guidance_scale": 3.5, "width": 1024, "height": 1024, "batch_size": 1},
     {"transformer": (3, 0), "positive": (2, 0)}),
    (5, "VAEDecodeSingleGPU", [1250, 230], [320, 130], {"model": MODEL, "device": "auto"},
     {"samples": (4, 0), "backend": (1, 0)}),
    (6, "SaveImage", [1630, 230], [540, 600], {"filename_prefix": "parallel_flux1"}, {"images": (5, 0)}),
]
CONTROL_AFTER_GENERATE = "randomize"
NOTE = ("**Parallel Diffusers: FLUX.1, staged `device_map`**\n\n"
        "The text encoders are balanced across the GPUs and freed, then the transformer is spread over them "
        "(`device_map=\"auto\"`), then one GPU decodes: a model that does not fit one GPU fits several.\n\n"
        "**Model**: a diffusers folder (`save_pretrained`, safetensors) in `ComfyUI/models/diffusers/`:\n\n"
        "```\nComfyUI/models/diffusers/FLUX.1-dev/\n  model_index.json\n  transformer/ text_encoder/ "
        "text_encoder_2/\n  tokenizer/ tokenizer_2/ scheduler/ vae/\n```\n\n"
        "Pick it in the three `model` widgets.\n\n"
        "**Parallel Backend**: `ranks` 0 = one rank per visible GPU. `max_memory` (e.g. `0:20GB,1:20GB`) "
        "caps what each GPU may hold.")


def describe(class_name):
    if class_name == "SaveImage":
        return SAVE_IMAGE["INPUT_TYPES"], SAVE_IMAGE["RETURN_TYPES"], SAVE_IMAGE["RETURN_NAMES"], SAVE_IMAGE["title"]
    cls = NODE_CLASS_MAPPINGS[class_name]
    return (cls.INPUT_TYPES(), cls.RETURN_TYPES, getattr(cls, "RETURN_NAMES", None) or cls.RETURN_TYPES,
            NODE_DISPLAY_NAME_MAPPINGS.get(class_name, class_name))


def is_widget(spec):
    kind, options = spec[0], (spec[1] if len(spec) > 1 else {}) or {}
    return (isinstance(kind, (list, tuple)) or kind in WIDGET_TYPES) and not options.get("forceInput")


def default_of(spec):
    kind, options = spec[0], (spec[1] if len(spec) > 1 else {}) or {}
    if "default" in options:
        return options["default"]
    if isinstance(kind, (list, tuple)):
        return kind[0] if kind else None
    return {"INT": 0, "FLOAT": 0.0, "STRING": "", "BOOLEAN": False}[kind]


def build():
    ui_nodes, links, api = [], [], {}
    specs = {nid: describe(cls) for nid, cls, *_ in NODES}
    for order, (nid, cls, pos, size, values, sockets) in enumerate(NODES):
        input_types, return_types, return_names, title = specs[nid]
        widgets_values, ui_inputs, api_inputs = [], [], {}
        for section in ("required", "optional"):
            for name, spec in input_types.get(section, {}).items():
                options = (spec[1] if len(spec) > 1 else {}) or {}
                if is_widget(spec):
                    value = values[name] if name in values else default_of(spec)
                    widgets_values.append(value)
                    if options.get("control_after_generate"):
                        widgets_values.append(CONTROL_AFTER_GENERATE)
                    api_inputs[name] = value
                elif name in sockets:
                    origin, slot = sockets[name]
                    link_id = len(links) + 1
                    links.append([link_id, origin, slot, nid, len(ui_inputs), spec[0]])
                    ui_inputs.append({"name": name, "type": spec[0], **({"shape": 7} if section == "optional" else {}),
                                      "link": link_id})
                    api_inputs[name] = [str(origin), slot]
                elif section == "required":
                    raise SystemExit(f"{cls}.{name} is a required socket and nothing feeds it")
        unknown = (set(values) | set(sockets)) - {n for s in input_types.values() for n in s}
        if unknown:
            raise SystemExit(f"{cls} has no input(s) {sorted(unknown)}")
        ui_nodes.append({"id": nid, "type": cls, "pos": pos, "size": size, "flags": {}, "order": order, "mode": 0,
                         "inputs": ui_inputs, "outputs": [], "properties": {"Node name for S&R": cls,
                                                                            **(CORE if cls == "SaveImage" else PACK)},
                         "widgets_values": widgets_values})
        api[str(nid)] = {"class_type": cls, "inputs": api_inputs, "_meta": {"title": title}}
    for node in ui_nodes:
        _, return_types, return_names, _ = specs[node["id"]]
        node["outputs"] = [{"name": name, "type": typ, "slot_index": slot,
                            "links": [l[0] for l in links if l[1] == node["id"] and l[2] == slot]}
                           for slot, (name, typ) in enumerate(zip(return_names, return_types))]
    ui_nodes.append({"id": len(NODES) + 1, "type": "MarkdownNote", "pos": [40, 520], "size": [320, 440],
                     "flags": {}, "order": len(NODES), "mode": 0, "inputs": [], "outputs": [], "properties": {},
                     "widgets_values": [NOTE], "color": "#432", "bgcolor": "#653"})
    ui = {"id": "5d1c2a53-6f5e-4e3b-9a77-1c0f6e0d2f41", "revision": 0, "last_node_id": len(NODES) + 1,
          "last_link_id": len(links), "nodes": ui_nodes, "links": links, "groups": [], "config": {},
          "extra": {"ds": {"scale": 0.75, "offset": [0, 0]}}, "version": 0.4}
    return ui, api


def main():
    ui, api = build()
    for path, doc in ((os.path.join(HERE, "flux1_device_map.json"), ui),
                      (os.path.join(HERE, "api", "flux1_device_map_api.json"), api)):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=2, ensure_ascii=False)
            f.write("\n")
        print("wrote", os.path.relpath(path))


if __name__ == "__main__":
    main()
