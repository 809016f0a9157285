"""The pack's HTTP routes on ComfyUI's server: the backend status panel's data and its button.

``GET /parallel_diffusers/status`` — ranks, device and memory per rank, resident models, the last error (the
same JSON serves scripts). ``POST /parallel_diffusers/shutdown`` — stop the backend and free its GPUs for
ComfyUI's own nodes. ``POST /parallel_diffusers/free`` — unload the resident models, keep the ranks.
After every node run the panel is pushed a fresh status as the ``parallel_diffusers.status`` event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

import parallel_runtime

from . import comfy

_registered = False


async def _in_thread(fn: Callable[[], dict]) -> dict:
    return await asyncio.get_running_loop().run_in_executor(None, fn)


def register() -> None:
    """Add the routes and the validation hook to ComfyUI's running server; nothing outside one (the tests)."""
    global _registered
    server = comfy._server()
    if server is None or _registered:
        return
    _registered = True
    server.add_on_prompt_handler(comfy.keep_queued_prompt)
    server.routes.get("/parallel_diffusers/status")(status)
    server.routes.post("/parallel_diffusers/shutdown")(shutdown)
    server.routes.post("/parallel_diffusers/free")(free)


async def status(request: web.Request) -> web.Response:
    return web.json_response(await _in_thread(comfy.snapshot))


async def shutdown(request: web.Request) -> web.Response:
    def stop() -> dict:
        backend = parallel_runtime.current_backend()
        if backend is not None:
            backend.cancel()  # a running op stops at its next step instead of holding the backend
        parallel_runtime.shutdown_backend()
        return comfy.snapshot()

    data = await _in_thread(stop)
    comfy._server().send_sync(comfy.STATUS_EVENT, data)
    return web.json_response(data)


async def free(request: web.Request) -> web.Response:
    def unload() -> dict:
        backend = parallel_runtime.current_backend()
        if backend is not None and backend.running:
            backend.free()
        return comfy.snapshot()

    data = await _in_thread(unload)
    comfy._server().send_sync(comfy.STATUS_EVENT, data)
    return web.json_response(data)
