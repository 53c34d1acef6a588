#!/usr/bin/env python3
"""Smoke checks of the real, unmodified SGLang server on CPU (the behaviours realscale uses).

    python scripts/sglang_cpu/smoke.py --python /work/venv-sglang/bin/python --model DIR [--checks ...]

DIR is a Hugging Face model directory (a tiny Qwen2: ``realscale.models.tiny.build_tiny_model``).
The venv is the one ``scripts/sglang_cpu/install.sh`` makes. This file needs only the
standard library; the parts that need torch (the trainer side of the weight group, the
Hugging Face reference, a perturbed copy of the weights) run as ``--python`` subprocesses
of this same file (``_helper ...``).

One server runs at a time, in its own session (process group), with few threads
(``--threads``, default 2); every process this script starts is killed before it exits.
Each check prints one line (PASS / FAIL / INFO) with what was observed and where SGLang's
source decides it (file:line in the installed package, found by an anchor string);
``--json FILE`` writes everything observed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.request
from typing import Any

ALL_CHECKS = ("generate", "abort_request", "pause_abort", "health_paused", "pause_retract", "pause_in_place",
              "weights_distributed", "weights_disk", "tp2")
PROMPT = [40, 41, 42, 43, 44, 45, 46, 47]  # token ids (the tiny tokenizer: one byte each)
LONG = 400  # max_new_tokens of a request that is still running when a pause arrives (~40 tok/s/req here)


# ----------------------------------------------------------------------------- plumbing

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: Any = None, timeout: float = 120.0) -> tuple[int, Any, float]:
    """(status, parsed JSON body or text, seconds)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return -1, f"{type(exc).__name__}: {exc}", time.monotonic() - t0
    elapsed = time.monotonic() - t0
    try:
        return status, json.loads(raw), elapsed
    except ValueError:
        return status, raw.decode(errors="replace"), elapsed


class Call(threading.Thread):
    """An HTTP call on a thread: ``.result`` = (status, body, seconds), ``.done_at`` (monotonic)."""

    def __init__(self, method: str, url: str, body: Any = None, timeout: float = 300.0) -> None:
        super().__init__(daemon=True)
        self.args_ = (method, url, body, timeout)
        self.result: tuple[int, Any, float] | None = None
        self.done_at: float | None = None
        self.start()

    def run(self) -> None:
        self.result = http(*self.args_)
        self.done_at = time.monotonic()


class Stream(threading.Thread):
    """A streaming /generate: records when each chunk arrived and the last chunk."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {**body, "stream": True}
        self.times: list[float] = []
        self.lengths: list[int] = []  # output_ids of each chunk (cumulative)
        self.last: Any = None
        self.status: int | None = None
        self.error: str | None = None
        self.start()

    def run(self) -> None:
        req = urllib.request.Request(self.url + "/generate", data=json.dumps(self.body).encode(),
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                self.status = resp.status
                for line in resp:
                    line = line.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    self.last = json.loads(line[5:])
                    self.times.append(time.monotonic())
                    self.lengths.append(len(self.last.get("output_ids") or []))
        except Exception as exc:  # noqa: BLE001 - reported
            self.error = f"{type(exc).__name__}: {exc}"

    def chunks_between(self, t0: float, t1: float) -> int:
        return sum(t0 <= t <= t1 for t in self.times)

    def tokens_at(self, t: float) -> int:
        """Tokens received by time ``t``."""
        return max([n for n, at in zip(self.lengths, self.times) if at <= t], default=0)


class Server:
    """``python -m sglang.launch_server`` in a new session; stop() kills its process group."""

    def __init__(self, python: str, model: str, log_path: str, threads: int, tp: int = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [python, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--device", "cpu", "--attention-backend", "torch_native",
               "--sampling-backend", "pytorch", "--disable-cuda-graph", "--dtype", "float32",
               "--skip-server-warmup", "--sleep-on-idle", "--grammar-backend", "none",
               "--mem-fraction-static", "0.05", "--max-total-tokens", "8192", "--random-seed", "0",
               "--weight-version", "v0"]
        if tp != 1:
            cmd += ["--tp-size", str(tp)]
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": str(threads),
               "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
        if tp > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in env:
            # without it SGLang wants one NUMA node per rank (sglang/srt/utils/numa_utils.py,
            # init_threads_binding); here: the CPUs we may use, split between the ranks
            env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_bind(tp)
            env["OMP_NUM_THREADS"] = str(max(1, min(threads, len(os.sched_getaffinity(0)) // tp)))
        self.env_note = {k: env[k] for k in ("OMP_NUM_THREADS", "SGLANG_CPU_OMP_THREADS_BIND") if k in env}
        self.cmd = cmd
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.t_start = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 240.0) -> dict:
        """Seconds until /model_info answers 200 (HTTP up) and until /health answers 200."""
        out: dict[str, Any] = {}
        deadline = self.t_start + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was ready; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            status, _, _ = http("GET", self.url + "/model_info", timeout=5)
            if status == 200:
                out.setdefault("http_up_s", round(time.monotonic() - self.t_start, 1))
                status, _, _ = http("GET", self.url + "/health", timeout=30)
                if status == 200:
                    out["healthy_s"] = round(time.monotonic() - self.t_start, 1)
                    return out
            time.sleep(0.5)
        raise TimeoutError(f"server not ready in {timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return "".join(fh.readlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> float:
        """SIGTERM the process group, SIGKILL it after 15 s; returns the seconds it took."""
        t0 = time.monotonic()
        try:
            pgid = os.getpgid(self.proc.pid)
        except ProcessLookupError:
            pgid = None
        if pgid is not None:
            _killpg(pgid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
            _killpg(pgid, signal.SIGKILL)  # the scheduler/detokenizer children too
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()
        return round(time.monotonic() - t0, 1)


def cpu_bind(ranks: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` giving each rank its share of our CPUs: "0|1", "0-3|4-7"."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // ranks)
    groups = [cpus[(i * per) % len(cpus):(i * per) % len(cpus) + per] for i in range(ranks)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Helper:
    """A ``_helper`` subprocess of this file under the venv's python (needs torch)."""

    def __init__(self, python: str, *args: str, env: dict | None = None) -> None:
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "_helper", *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})

    def send(self, obj: Any) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout: float = 120.0) -> Any:
        box: list = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        if not box or not box[0]:
            raise RuntimeError(f"helper gave no answer in {timeout:.0f} s; stderr: {self.stderr_tail()}")
        return json.loads(box[0])

    def stderr_tail(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read()[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        if self.proc.poll() is None:
            _killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def run_helper(python: str, *args: str, timeout: float = 300.0) -> Any:
    res = subprocess.run([python, os.path.abspath(__file__), "_helper", *args], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if res.returncode != 0:
        raise RuntimeError(f"helper {args[0]} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- SGLang source lines

class Source:
    """file:line of an anchor string in the installed SGLang (relative to site-packages)."""

    def __init__(self, python: str) -> None:
        res = subprocess.run([python, "-c", "import importlib.util,os;"
                              "print(os.path.dirname(list(importlib.util.find_spec('sglang')"
                              ".submodule_search_locations)[0]))"], capture_output=True, text=True)
        self.root = res.stdout.strip()

    def __call__(self, rel: str, anchor: str, nth: int = 1) -> str:
        try:
            with open(os.path.join(self.root, rel), encoding="utf-8") as fh:
                seen = 0
                for i, line in enumerate(fh, 1):
                    if anchor in line:
                        seen += 1
                        if seen == nth:
                            return f"{rel}:{i}"
        except OSError:
            pass
        return f"{rel}:? ({anchor!r} not found)"


HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
TOKENIZER = "sglang/srt/managers/tokenizer_manager.py"
TOK_CONTROL = "sglang/srt/managers/tokenizer_control_mixin.py"
SCHEDULER = "sglang/srt/managers/scheduler.py"
SCHED_WU = "sglang/srt/managers/scheduler_components/weight_updater.py"
RUNNER_WU = "sglang/srt/model_executor/model_runner_components/weight_updater.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
COMMON = "sglang/srt/utils/common.py"


# ----------------------------------------------------------------------------- checks

class Smoke:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.python = args.python
        self.src = Source(args.python)
        self.work = tempfile.mkdtemp(prefix="sglang-smoke-")
        self.results: list[dict] = []
        self.server: Server | None = None
        self.helpers: list[Helper] = []
        self.ref: dict = {}

    # -- reporting
    def record(self, check: str, verdict: str, observed: Any, source: list[str] | str = ()) -> None:
        source = [source] if isinstance(source, str) else list(source)
        self.results.append({"check": check, "verdict": verdict, "observed": observed, "source": source})
        text = json.dumps(observed, default=str)
        if len(text) > 900:
            text = text[:900] + "..."
        print(f"[{verdict}] {check}: {text}", flush=True)
        for s in source:
            print(f"        source: {s}", flush=True)

    # -- helpers
    def start(self, model: str, tp: int = 1, name: str = "server") -> dict:
        self.stop()
        log = os.path.join(self.work, f"{name}.log")
        self.server = Server(self.python, model, log, self.args.threads, tp=tp)
        ready = self.server.wait_ready()
        return {**ready, "env": self.server.env_note, "log": log}

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def gen_body(self, n: int, ids: list[int] | None = None, logprob: bool = False, **extra: Any) -> dict:
        body = {"input_ids": ids or PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": n,
                                                                 "ignore_eos": True}}
        if logprob:
            body["return_logprob"] = True
        return {**body, **extra}

    def generate(self, n: int, **kw: Any) -> tuple[int, Any, float]:
        return http("POST", self.url + "/generate", self.gen_body(n, **kw), timeout=600)

    def greedy(self, n: int = 24) -> dict:
        status, body, _ = self.generate(n, logprob=True)
        if status != 200:
            raise RuntimeError(f"/generate answered {status}: {body}")
        lps = body["meta_info"]["output_token_logprobs"]
        return {"ids": body["output_ids"], "logprobs": [lp[0] for lp in lps], "meta": body["meta_info"]}

    def wait_running(self, calls_started: float, min_s: float = 2.0) -> None:
        time.sleep(max(0.0, calls_started + min_s - time.monotonic()))

    def compare(self, a: dict, b: dict) -> dict:
        n = min(len(a["ids"]), len(b["ids"]))
        return {"ids_equal": a["ids"] == b["ids"],
                "max_abs_logprob_diff": max((abs(x - y) for x, y in zip(a["logprobs"][:n], b["logprobs"][:n])),
                                            default=None)}

    def hf_ref(self, model: str, n: int = 24) -> dict:
        return run_helper(self.python, "hf_ref", model, json.dumps(PROMPT), str(n))

    # -- 1. generation
    def check_generate(self) -> None:
        a = self.greedy()
        b = self.greedy()
        hf = self.hf_ref(self.args.model)
        meta = a["meta"]
        observed = {
            "output_ids[:8]": a["ids"][:8], "len": len(a["ids"]),
            "meta_info.output_token_logprobs[0]": meta["output_token_logprobs"][0],
            "finish_reason": meta["finish_reason"], "weight_version": meta.get("weight_version"),
            "weight_versions": meta.get("weight_versions"),
            "second_call(prompt now in the radix cache)": {**self.compare(a, b), "cached_tokens": b["meta"].get(
                "cached_tokens")}, "vs_hf": self.compare(a, hf)}
        ok = observed["vs_hf"]["ids_equal"] and observed["vs_hf"]["max_abs_logprob_diff"] < 1e-4 and \
            self.compare(a, b)["ids_equal"]
        self.ref["v0"] = a
        self.record("generate", "PASS" if ok else "FAIL", observed, [
            self.src(HTTP_SERVER, '"/generate",'), self.src(TOKENIZER, "def convert_logprob_style")])

    # -- 2. /abort_request by rid
    def check_abort_request(self) -> None:
        rid = "smoke-abort-1"
        call = Call("POST", self.url + "/generate", self.gen_body(LONG, rid=rid))
        time.sleep(2.0)
        st, body, el = http("POST", self.url + "/abort_request", {"rid": rid})
        call.join(60)
        status, out, _ = call.result or (None, None, None)
        observed = {"abort_request": [st, body, round(el, 2)], "generate_status": status,
                    "finish_reason": out["meta_info"]["finish_reason"] if isinstance(out, dict) else out,
                    "partial_tokens": len(out.get("output_ids", [])) if isinstance(out, dict) else None}
        ok = status == 200 and observed["finish_reason"]["type"] == "abort"
        self.record("abort_request", "PASS" if ok else "FAIL", observed,
                    [self.src(HTTP_SERVER, '"/abort_request"'), self.src(TOKENIZER, "def _handle_abort_finish_reason")])

    # -- 3. pause abort (+ a request submitted while paused, + continue)
    def check_pause_abort(self, health: bool) -> None:
        t0 = time.monotonic()
        calls = [Call("POST", self.url + "/generate", self.gen_body(LONG, logprob=True)) for _ in range(3)]
        stream = Stream(self.url, self.gen_body(LONG))
        self.wait_running(t0)
        t_paused = time.monotonic()
        st, body, el = http("POST", self.url + "/pause_generation", {"mode": "abort"})
        for c in calls:
            c.join(60)
        stream.join(60)
        results = []
        for c in calls:
            status, out, _ = c.result
            results.append({"status": status, "finish_reason": out["meta_info"]["finish_reason"],
                            "partial_tokens": len(out["output_ids"]),
                            "logprobs_returned": len(out["meta_info"].get("output_token_logprobs") or []),
                            "weight_versions": out["meta_info"].get("weight_versions"),
                            "returned_s_after_pause_sent": round(c.done_at - t_paused, 2)})
        late = Call("POST", self.url + "/generate", self.gen_body(8))
        time.sleep(3.0)
        waiting = late.result is None
        observed = {"pause": [st, body, round(el, 2)], "aborted": results,
                    "stream": {"status": stream.status, "error": stream.error,
                               "last_finish_reason": (stream.last or {}).get("meta_info", {}).get("finish_reason")},
                    "new_request_waits_while_paused": waiting}
        if health:
            observed["health_while_paused"] = self.health_paused()
        st2, body2, el2 = http("POST", self.url + "/continue_generation", {})
        late.join(60)
        observed["continue"] = [st2, body2, round(el2, 2)]
        observed["waiting_request_after_continue"] = None if late.result is None else {
            "status": late.result[0], "finish_reason": late.result[1]["meta_info"]["finish_reason"],
            "tokens": len(late.result[1]["output_ids"])}
        after = http("GET", self.url + "/health", timeout=60)
        observed["health_after_continue"] = [after[0], round(after[2], 2)]
        ok = st == 200 and all(r["status"] == 200 and r["finish_reason"]["type"] == "abort" for r in results) \
            and waiting and late.result is not None and late.result[0] == 200
        self.record("pause_abort", "PASS" if ok else "FAIL", observed, [
            self.src(HTTP_SERVER, '@app.post("/pause_generation")'),
            self.src(TOKENIZER, "async def pause_generation"),
            self.src(TOKENIZER, "await self.is_pause_cond.wait_for(lambda: not self.is_pause)"),
            self.src(TOKENIZER, '"type": "abort"'), self.src(TOKENIZER, "def _handle_abort_finish_reason"),
            self.src(HTTP_SERVER, '@app.post("/continue_generation")'),
            self.src(SCHEDULER, "def continue_generation")])

    def health_paused(self) -> dict:
        out = {}
        for path in ("/health", "/health_generate"):
            st, _, el = http("GET", self.url + path, timeout=120)
            out[path] = {"status": st, "seconds": round(el, 1)}
        return out

    def record_health(self, observed: dict) -> None:
        h = observed.get("health_while_paused") or {}
        ok = all(v["status"] == 503 for v in h.values()) if h else False
        self.record("health_paused", "INFO" if ok else "FAIL", h, [
            self.src(HTTP_SERVER, '@app.get("/health")'), self.src(HTTP_SERVER, "HEALTH_CHECK_TIMEOUT = "),
            self.src(HTTP_SERVER, "while time.time() < tic + HEALTH_CHECK_TIMEOUT"),
            self.src(HTTP_SERVER, "server_status = ServerStatus.UnHealthy"),
            self.src("sglang/srt/environ.py", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION =")])

    # -- 4. retract / in_place
    def check_pause_keep(self, mode: str) -> dict:
        t0 = time.monotonic()
        calls = [Call("POST", self.url + "/generate", self.gen_body(LONG, logprob=True)) for _ in range(2)]
        stream = Stream(self.url, self.gen_body(LONG))
        self.wait_running(t0)
        t_pause = time.monotonic()
        st, body, el = http("POST", self.url + "/pause_generation", {"mode": mode})
        t_paused = time.monotonic()
        time.sleep(5.0)
        t_check = time.monotonic()
        # tokens already computed when the pause arrived may still be on their way out
        settled = t_paused + 1.5
        chunks_during = stream.chunks_between(settled, t_check)
        finished_during = sum(c.result is not None for c in calls)
        st2, body2, el2 = http("POST", self.url + "/continue_generation", {})
        for c in calls:
            c.join(120)
        stream.join(120)
        results = []
        for c in calls:
            status, out, _ = c.result
            m = out["meta_info"]
            results.append({"status": status, "finish_reason": m["finish_reason"], "tokens": len(out["output_ids"]),
                            "num_retractions": m.get("num_retractions"),
                            "logprobs": len(m.get("output_token_logprobs") or [])})
        observed = {"pause": [st, body, round(el, 2)],
                    "stream_tokens": {"at_pause": stream.tokens_at(t_pause), "pause+1.5s": stream.tokens_at(settled),
                                      "at_continue(pause+5s)": stream.tokens_at(t_check)},
                    "stream_chunks_arriving_after_pause_s": [round(t - t_pause, 2) for t in stream.times
                                                             if t_pause <= t <= t_check],
                    "stream_chunks_during_pause(after +1.5 s)": chunks_during,
                    "requests_finished_during_pause": finished_during,
                    "continue": [st2, body2, round(el2, 2)], "after_continue": results,
                    "stream_after": {"error": stream.error, "tokens": len((stream.last or {}).get("output_ids") or []),
                                     "finish_reason": (stream.last or {}).get("meta_info", {}).get("finish_reason")}}
        ok = st == 200 and chunks_during == 0 and finished_during == 0 and all(
            r["status"] == 200 and r["tokens"] == LONG and r["finish_reason"]["type"] == "length" for r in results)
        src = [self.src(TOKENIZER, "async def pause_generation"), self.src(SCHEDULER, "def pause_generation"),
               self.src(SCHEDULER, 'if recv_req.mode == "in_place":') if mode == "in_place"
               else self.src(SCHEDULER, "retract_all("), self.src(SCHEDULER, "def continue_generation")]
        self.record(f"pause_{mode}", "PASS" if ok else "FAIL", observed, src)
        return observed

    # -- 5. weight update over gloo
    def trainer(self, port: int, world: int, group: str, weights: str, timeout: float = 60.0) -> Helper:
        h = Helper(self.python, "trainer", "127.0.0.1", str(port), str(world), group, weights, str(timeout))
        h.port = port
        self.helpers.append(h)
        return h

    def init_group(self, trainer_world: int, group: str, weights: str, rank_offset: int = 1) -> tuple[Helper, dict]:
        port = free_port()
        tr = self.trainer(port, trainer_world, group, weights)
        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": rank_offset,
                "world_size": trainer_world, "group_name": group, "backend": "gloo"}
        st, resp, el = http("POST", self.url + "/init_weights_update_group", body, timeout=120)
        connected = tr.read(60)
        return tr, {"status": st, "body": resp, "seconds": round(el, 2), "trainer": connected}

    def push(self, tr: Helper, meta: dict, names: list[str] | None = None, flat: bool = False,
             **fields: Any) -> tuple[int, Any]:
        """One /update_weights_from_distributed of ``names`` (default: all) while the trainer broadcasts."""
        names = names or list(meta)
        body = {"names": names, "dtypes": [meta[n]["dtype"] for n in names],
                "shapes": [meta[n]["shape"] for n in names], "group_name": fields.pop("group_name", "smoke"),
                **fields}
        if flat:
            body["load_format"] = "flattened_bucket"
        call = Call("POST", self.url + "/update_weights_from_distributed", body, timeout=120)
        tr.send({"names": names, "flat": flat})
        sent = tr.read(120)
        call.join(120)
        return call.result[0], {"body": call.result[1], "trainer": sent}

    def check_weights_distributed(self, w1: str, w1_meta: dict, tp: int = 1, name: str = "weights_distributed") -> None:
        world = 1 + tp
        tr, init = self.init_group(world, "smoke", w1)
        observed: dict[str, Any] = {"init_weights_update_group(gloo)": init}
        if init["status"] != 200:
            self.record(name, "FAIL", observed)
            tr.close()
            return
        # outside a begin/end session: refused (the trainer is not told to send)
        names = list(w1_meta)[:1]
        st, body, _ = http("POST", self.url + "/update_weights_from_distributed",
                           {"names": names, "dtypes": [w1_meta[names[0]]["dtype"]],
                            "shapes": [w1_meta[names[0]]["shape"]], "group_name": "smoke"})
        observed["outside_session"] = [st, body]
        st_b, body_b, _ = http("POST", self.url + "/begin_weight_update", {})
        half = len(w1_meta) // 2
        all_names = list(w1_meta)
        st1, r1 = self.push(tr, w1_meta, all_names[:half], flush_cache=False)
        st2, r2 = self.push(tr, w1_meta, all_names[half:], flat=True, weight_version="v1")
        st_e, body_e, _ = http("POST", self.url + "/end_weight_update", {})
        observed["session"] = {"begin": [st_b, body_b], "update(per-tensor, flush_cache=false)": [st1, r1["body"]],
                               "update(flattened_bucket, weight_version=v1)": [st2, r2["body"]],
                               "end": [st_e, body_e]}
        after = self.greedy()
        hf = self.hf_ref(w1)
        observed["generate_after"] = {"weight_version": after["meta"].get("weight_version"),
                                      "weight_versions": after["meta"].get("weight_versions"),
                                      "vs_hf(new weights)": self.compare(after, hf),
                                      "changed_from_v0": after["ids"] != self.ref.get("v0", {}).get("ids")}
        self.ref[f"dist_tp{tp}"] = after
        # the group name again, while the first group lives: a second trainer that gives up after 20 s
        tr2 = self.trainer(free_port(), world, "smoke", w1, timeout=20.0)
        body = {"master_address": "127.0.0.1", "master_port": tr2.port, "rank_offset": 1,
                "world_size": world, "group_name": "smoke", "backend": "gloo"}
        st3, b3, el3 = http("POST", self.url + "/init_weights_update_group", body, timeout=120)
        try:
            t2 = tr2.read(60)
        except RuntimeError as exc:
            t2 = str(exc)[:300]
        observed["reuse_group_name"] = {"status": st3, "body": b3, "seconds": round(el3, 1), "trainer": t2}
        tr2.close()
        st4, b4, _ = http("POST", self.url + "/destroy_weights_update_group", {"group_name": "smoke"})
        observed["destroy_weights_update_group"] = [st4, b4]
        tr.close()
        v = observed["generate_after"]["vs_hf(new weights)"]
        ok = st == 400 and st1 == 200 and st2 == 200 and st_e == 200 and v["ids_equal"] and \
            v["max_abs_logprob_diff"] < 1e-4
        self.record(name, "PASS" if ok else "FAIL", observed, [
            self.src(HTTP_SERVER, '@app.post("/init_weights_update_group")'),
            self.src(RUNNER_WU, "def init_weights_update_group"), self.src(COMMON, "def init_custom_process_group"),
            self.src(SCHED_WU, "update_weights_from_distributed must run between"),
            self.src(SCHED_WU, "def begin_weight_update"), self.src(SCHED_WU, "def end_weight_update"),
            self.src(RUNNER_WU, "def receive_weights_from_distributed"),
            self.src(RUNNER_WU, "def _receive_bucketed_weights_from_distributed"),
            self.src(TOK_CONTROL, "async def update_weights_from_distributed")])

    def check_update_under_in_place(self, w1: str, w1_meta: dict) -> None:
        """A weight update W0 -> W1 (default flush_cache) while an in_place pause holds a running
        request; then whether the radix cache still serves KV computed under W0."""
        tr, init = self.init_group(2, "smoke", w1)
        t0 = time.monotonic()
        call = Call("POST", self.url + "/generate", self.gen_body(LONG, logprob=True))
        self.wait_running(t0)
        st_p, _, _ = http("POST", self.url + "/pause_generation", {"mode": "in_place"})
        http("POST", self.url + "/begin_weight_update", {})
        st, r = self.push(tr, w1_meta, weight_version="w1-in-place")
        st_e, body_e, _ = http("POST", self.url + "/end_weight_update", {})
        st_f, body_f, _ = http("POST", self.url + "/flush_cache", {})
        st_c, _, _ = http("POST", self.url + "/continue_generation", {})
        call.join(120)
        out = call.result[1]
        fresh_w1 = self.ref.get("dist_tp1")
        stale = self.greedy()
        st_f2, body_f2, _ = http("POST", self.url + "/flush_cache", {})
        flushed = self.greedy()
        observed = {"init": init["status"], "pause(in_place)": st_p,
                    "update(flush_cache default true)": [st, r["body"]], "end": [st_e, body_e],
                    "flush_cache while paused with a running request": [st_f, body_f],
                    "continued_request": {"status": call.result[0], "finish_reason": out["meta_info"]["finish_reason"],
                                          "tokens": len(out["output_ids"]),
                                          "weight_versions": out["meta_info"].get("weight_versions")},
                    "next_request_same_prompt(unflushed cache)": {
                        "cached_tokens": stale["meta"].get("cached_tokens"),
                        "vs_fresh_W1": self.compare(stale, fresh_w1) if fresh_w1 else None},
                    "flush_cache when idle": [st_f2, body_f2],
                    "after_flush": {"cached_tokens": flushed["meta"].get("cached_tokens"),
                                    "exactly_fresh_W1": bool(fresh_w1) and flushed["ids"] == fresh_w1["ids"]
                                    and flushed["logprobs"] == fresh_w1["logprobs"]}}
        http("POST", self.url + "/destroy_weights_update_group", {"group_name": "smoke"})
        tr.close()
        self.record("update_under_in_place", "INFO" if st == 400 and st_f2 == 200 else "FAIL", observed, [
            self.src(SCHED_WU, "def flush_cache_after_weight_update"), self.src(SCHEDULER, "def flush_cache("),
            self.src(IO_STRUCT, "Note: In 'inplace' mode, flush_cache will fail"),
            self.src(HTTP_SERVER, '@app.api_route("/flush_cache"')])

    # -- 6. disk
    def check_weights_disk(self, w0: str, w1: str) -> None:
        st, body, el = http("POST", self.url + "/update_weights_from_disk", {"model_path": w1, "weight_version": "d1"})
        a = self.greedy()
        st0, body0, el0 = http("POST", self.url + "/update_weights_from_disk", {"model_path": w0, "weight_version": "d0"})
        b = self.greedy()
        observed = {"to_w1": [st, body, round(el, 2)], "w1_vs_distributed_w1": self.compare(a, self.ref["dist_tp1"])
                    if "dist_tp1" in self.ref else None,
                    "w1_exactly_equal_to_distributed": "dist_tp1" in self.ref and a["ids"] == self.ref["dist_tp1"]["ids"]
                    and a["logprobs"] == self.ref["dist_tp1"]["logprobs"],
                    "weight_version": a["meta"].get("weight_version"),
                    "back_to_w0": [st0, body0, round(el0, 2)], "w0_exactly_equal_to_start": a is not None and
                    b["ids"] == self.ref["v0"]["ids"] and b["logprobs"] == self.ref["v0"]["logprobs"]}
        ok = st == 200 and st0 == 200 and observed["w0_exactly_equal_to_start"]
        self.record("weights_disk", "PASS" if ok else "FAIL", observed, [
            self.src(HTTP_SERVER, '@app.post("/update_weights_from_disk")'),
            self.src(SCHED_WU, "def update_weights_from_disk"), self.src(RUNNER_WU, "def update_weights_from_disk")])

    # -- driver
    def run(self) -> int:
        checks = self.args.checks
        model = os.path.abspath(self.args.model)
        w1 = os.path.join(self.work, "w1")
        need_w1 = {"weights_distributed", "weights_disk", "tp2", "pause_in_place"} & set(checks)
        w1_meta = run_helper(self.python, "perturb", model, w1, "1") if need_w1 else {}
        try:
            ready = self.start(model)
            self.record("startup", "INFO", {**ready, "cmd": " ".join(self.server.cmd)},
                        [self.src(HTTP_SERVER, 'The server is fired up and ready to roll!')])
            if "generate" in checks or need_w1:
                self.check_generate()
            if "abort_request" in checks:
                self.check_abort_request()
            if "pause_abort" in checks:
                self.check_pause_abort(health="health_paused" in checks)
                if "health_paused" in checks:
                    self.record_health(self.results[-1]["observed"])
            if "pause_retract" in checks:
                self.check_pause_keep("retract")
            if "pause_in_place" in checks:
                self.check_pause_keep("in_place")
            if "weights_distributed" in checks:
                self.check_weights_distributed(w1, w1_meta)
            if "weights_disk" in checks:
                self.check_weights_disk(model, w1)
            if "pause_in_place" in checks and "weights_distributed" in checks:
                self.check_update_under_in_place(w1, w1_meta)
            if "tp2" in checks:
                self.check_tp2(model, w1, w1_meta)
        except Exception:  # noqa: BLE001 - reported, then everything is stopped
            tb = traceback.format_exc()
            self.record("error", "FAIL", tb[-3000:])
            if self.server is not None:
                print(self.server.log_tail(), file=sys.stderr)
        finally:
            for h in self.helpers:
                h.close()
            self.stop()
        if self.args.json:
            with open(self.args.json, "w", encoding="utf-8") as fh:
                json.dump(self.results, fh, indent=1, default=str)
        fails = sum(r["verdict"] == "FAIL" for r in self.results)
        print(f"{sum(r['verdict'] == 'PASS' for r in self.results)} passed, {fails} failed "
              f"({sum(r['verdict'] == 'INFO' for r in self.results)} info); logs in {self.work}")
        return 1 if fails else 0

    def check_tp2(self, model: str, w1: str, w1_meta: dict) -> None:
        try:
            ready = self.start(model, tp=2, name="server_tp2")
        except Exception as exc:  # noqa: BLE001 - the observation
            self.record("tp2", "FAIL", {"startup_error": str(exc)[-3000:]},
                        [self.src(SCHEDULER, "def run_scheduler_process")])
            return
        t0 = time.monotonic()
        a = self.greedy()
        first_s = round(time.monotonic() - t0, 1)
        t0 = time.monotonic()
        st, out, el = self.generate(64)
        cmp = self.compare(a, self.ref["v0"])
        self.record("tp2_startup_generate", "PASS" if cmp["ids_equal"] and cmp["max_abs_logprob_diff"] < 1e-4
                    else "FAIL", {**ready, "first_request_s": first_s, "64_tokens_s": round(el, 2), "vs_tp1": cmp},
                    [self.src("sglang/srt/utils/numa_utils.py", "def init_threads_binding")])
        self.check_weights_distributed(w1, w1_meta, tp=2, name="tp2_weights_distributed")
        if "dist_tp1" in self.ref and "dist_tp2" in self.ref:
            self.record("tp2_vs_tp1_after_update", "INFO", self.compare(self.ref["dist_tp2"], self.ref["dist_tp1"]))


# ----------------------------------------------------------------------------- helpers (venv python, torch)

def _helper(argv: list[str]) -> None:
    import torch  # noqa: PLC0415 - only in the venv's helper processes

    cmd = argv[0]
    if cmd == "meta":
        from safetensors.torch import load_file
        state = load_file(os.path.join(argv[1], "model.safetensors"))
        print(json.dumps({k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
                          for k, v in state.items()}))
    elif cmd == "perturb":  # SRC DST SEED: the same model with every weight moved a little
        from safetensors.torch import load_file, save_file
        src, dst, seed = argv[1], argv[2], int(argv[3])
        shutil.copytree(src, dst, dirs_exist_ok=True)
        state = load_file(os.path.join(src, "model.safetensors"))
        g = torch.Generator().manual_seed(seed)
        new = {k: (v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype)).contiguous() for k, v in state.items()}
        save_file(new, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
        print(json.dumps({k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
                          for k, v in new.items()}))
    elif cmd == "hf_ref":  # MODEL IDS N: greedy ids and their log-probs under transformers
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(argv[1], dtype=torch.float32).eval()
        ids = json.loads(argv[2])
        out_ids, lps = [], []
        with torch.no_grad():
            for _ in range(int(argv[3])):
                logits = model(torch.tensor([ids + out_ids])).logits[0, -1].double()
                lp = torch.log_softmax(logits, -1)
                t = int(torch.argmax(lp))
                out_ids.append(t)
                lps.append(float(lp[t]))
        print(json.dumps({"ids": out_ids, "logprobs": lps}))
    elif cmd == "trainer":  # ADDR PORT WORLD GROUP WEIGHTS TIMEOUT: rank 0 of SGLang's weight group
        import datetime

        from safetensors.torch import load_file
        from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper, _world,
                                                        rendezvous)
        addr, port, world, group_name, weights, timeout_s = argv[1], int(argv[2]), int(argv[3]), argv[4], argv[5], \
            float(argv[6])
        state = load_file(os.path.join(weights, "model.safetensors"))
        timeout = datetime.timedelta(seconds=timeout_s)
        t0 = time.monotonic()
        try:  # exactly as SGLang's init_custom_process_group (sglang/srt/utils/common.py)
            store, rank, world = next(rendezvous(f"tcp://{addr}:{port}", 0, world, timeout=timeout))
            store.set_timeout(timeout)
            store = PrefixStore(group_name, store)
            pg, _ = _new_process_group_helper(world, 0, [], Backend("gloo"), store, group_name=group_name,
                                              backend_options=None, timeout=timeout, device_id=None)
            _world.pg_group_ranks[pg] = {i: i for i in range(world)}
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            print(json.dumps({"connected": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                              "seconds": round(time.monotonic() - t0, 1)}), flush=True)
            return
        print(json.dumps({"connected": True, "seconds": round(time.monotonic() - t0, 2)}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            if req == "quit":
                break
            tensors = [state[n].contiguous() for n in req["names"]]
            if req.get("flat"):  # FlattenedTensorBucket: the tensors' bytes back to back
                tensors = [torch.cat([t.flatten().view(torch.uint8) for t in tensors])]
            t1 = time.monotonic()
            for t in tensors:
                pg.broadcast(t, 0).wait()
            print(json.dumps({"sent_bytes": sum(t.numel() * t.element_size() for t in tensors),
                              "broadcasts": len(tensors), "seconds": round(time.monotonic() - t1, 3)}), flush=True)
        torch.distributed.destroy_process_group(pg)
    else:
        raise SystemExit(f"unknown helper {cmd}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_helper":
        _helper(sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default=os.path.join(os.environ.get("SGLANG_VENV", "/work/venv-sglang"), "bin", "python"),
                   help="the SGLang venv's python (default: $SGLANG_VENV/bin/python)")
    p.add_argument("--model", required=True, help="a Hugging Face model directory (tiny Qwen2)")
    p.add_argument("--checks", nargs="+", default=list(ALL_CHECKS), choices=ALL_CHECKS)
    p.add_argument("--skip", nargs="+", default=[], choices=ALL_CHECKS)
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the server")
    p.add_argument("--json", help="write every observation to this file")
    args = p.parse_args()
    args.checks = [c for c in args.checks if c not in args.skip]
    return Smoke(args).run()


if __name__ == "__main__":
    sys.exit(main())
