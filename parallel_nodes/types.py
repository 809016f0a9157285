"""Socket types and the category shared by the pack's nodes."""

CATEGORY = "parallel_diffusers"
BACKEND = "PD_BACKEND"  # a parallel_runtime.BackendSpec
CONDITIONING = "PD_CONDITIONING"  # a parallel_runtime.jobs.Conditioning
TRANSFORMER = "PD_TRANSFORMER"  # a parallel_runtime.jobs.TransformerHandle

BACKEND_INPUT = (BACKEND, {"tooltip": "Which backend runs this (a ParallelBackend node). Without it: every visible "
                                      "GPU, or 2 CPU ranks when there is none (COMFY_PARALLEL_RANKS / "
                                      "COMFY_PARALLEL_DEVICE override)."})
DTYPE_INPUT = (["auto", "bfloat16", "float16", "float32"],
               {"default": "auto", "tooltip": "Weights' dtype. auto: bfloat16 on GPUs, float32 on CPU."})
MAX_MEMORY_INPUT = ("STRING", {"default": "", "tooltip": "Per-device budget for device_map placement, e.g. "
                                                        "0:16GB,1:16GB (GPU index or cpu). Empty: no limit."})
