"""The pack's HTTP routes on ComfyUI's server: the backend status panel's data and its button.

``GET /parallel_diffusers/status`` — ranks, device and memory per rank, resident models, the last error, and over
several machines the join commands without the secret (the same JSON serves scripts). ``POST
/parallel_diffusers/shutdown`` — stop the backend and free its GPUs for ComfyUI's own nodes. ``POST
/parallel_diffusers/free`` — unload the resident models, keep the ranks. After every node run the panel is pushed a
fresh status as the ``parallel_diffusers.status`` event.

``POST /parallel_diffusers/join`` — the join commands with the cluster secret, which lets a machine join the backend.
It is answered only to a client on this machine (a loopback peer address): ComfyUI started with ``--listen`` serves
every route to anyone who reaches its port, over plain HTTP, and has no login to tell the user from anyone else. The
peer address is the one test the server can make that a stranger on the network cannot pass; a reverse proxy on this
machine would pass it for everyone it forwards (the README says so). POST, not GET: a page of another site cannot
read the answer (no CORS), and ComfyUI refuses a cross-origin POST to a loopback host.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable

from aiohttp import web

import parallel_runtime
from parallel_runtime.machines import join_commands

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
    server.routes.post("/parallel_diffusers/join")(join)


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


def from_this_machine(request: web.Request) -> bool:
    """Whether the request's peer is this machine (a loopback address, also as IPv4-mapped IPv6)."""
    try:
        peer = ipaddress.ip_address((request.remote or "").split("%")[0])
    except ValueError:
        return False
    mapped = getattr(peer, "ipv4_mapped", None)
    return (mapped or peer).is_loopback


async def join(request: web.Request) -> web.Response:
    if not from_this_machine(request):
        return web.json_response(
            {
                "error": "the join commands with the cluster secret are shown only in a browser on the ComfyUI host "
                "itself (ComfyUI serves this page to anyone on the network who reaches it); there, or in its secret "
                "file, find the secret"
            },
            status=403,
        )
    backend = parallel_runtime.current_backend()
    if backend is None or backend.spec.nnodes == 1:
        return web.json_response({"error": "no backend over several machines is set up"}, status=404)
    spec = backend.spec
    return web.json_response(
        await _in_thread(lambda: {"join": join_commands(spec.rdzv_endpoint, spec.nnodes, with_secret=True)})
    )
