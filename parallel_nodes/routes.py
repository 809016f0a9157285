"""The pack's HTTP routes on ComfyUI's server: the backend status panel's data and its button.

``GET /parallel_diffusers/status`` — ranks, device and memory per rank, resident models, the last error (the
same JSON serves scripts). ``POST /parallel_diffusers/shutdown`` — stop the backend and free its GPUs for
ComfyUI's own nodes. ``POST /parallel_diffusers/free`` — unload the resident models, keep the ranks.
After every node run the panel is pushed a fresh status as the ``parallel_diffusers.status`` event.
"""
from __future__ import annotations

import asyncio

from aiohttp import web
from server import PromptServer

import parallel_runtime
from parallel_runtime.client import last_error

EVENT = "parallel_diffusers.status"


def snapshot() -> dict:
    backend = parallel_runtime.current_backend()
    if backend is None:
        return {"running": False, "busy": False, "spec": None, "last_error": last_error()}
    return backend.snapshot()


def push_status() -> None:
    """Send the panel a fresh status (from the node's thread; send_sync is thread-safe)."""
    PromptServer.instance.send_sync(EVENT, snapshot())


async def _in_thread(fn):
    return await asyncio.get_running_loop().run_in_executor(None, fn)


routes = PromptServer.instance.routes


@routes.get("/parallel_diffusers/status")
async def status(request: web.Request) -> web.Response:
    return web.json_response(await _in_thread(snapshot))


@routes.post("/parallel_diffusers/shutdown")
async def shutdown(request: web.Request) -> web.Response:
    def stop() -> dict:
        backend = parallel_runtime.current_backend()
        if backend is not None:
            backend.cancel()  # a running op stops at its next step instead of holding the backend
        parallel_runtime.shutdown_backend()
        return snapshot()

    data = await _in_thread(stop)
    PromptServer.instance.send_sync(EVENT, data)
    return web.json_response(data)


@routes.post("/parallel_diffusers/free")
async def free(request: web.Request) -> web.Response:
    def unload() -> dict:
        backend = parallel_runtime.current_backend()
        if backend is not None and backend.running:
            backend.call("free", timeout=120.0)
        return snapshot()

    data = await _in_thread(unload)
    PromptServer.instance.send_sync(EVENT, data)
    return web.json_response(data)
