"""ComfyUI node classes of the pack. Thin: they validate widgets and call parallel_runtime."""

NODE_CLASS_MAPPINGS: dict[str, type] = {}
NODE_DISPLAY_NAME_MAPPINGS: dict[str, str] = {}
