"""Fixtures for tests against a real vLLM on the CPU (skipped where vLLM is not installed).

This folder deliberately has no ``__init__.py``: with one, pytest's default ("prepend")
import mode would put ``tests/`` on ``sys.path`` and import this folder as the package
``vllm``, shadowing the real vLLM. The connector modules here are loaded by vLLM as
``tests.vllm.<module>`` (namespace packages) with the repository root on the path.

Every test in this directory is marked ``vllm``, and every test module starts with
``pytest.importorskip`` of a vLLM submodule, so the whole folder is reported skipped where
vLLM is not installed (this file imports neither vLLM nor transformers at import time, so
it loads everywhere). Where vLLM is installed, the environment variables below are set at
import time, before torch or vLLM starts any thread pool or child process
(``setdefault``: an explicit value from CI wins):

* ``OMP_NUM_THREADS=1``: on a 2-core machine two OpenMP threads per process turn a 1.5 ms
  decode step into ~100 ms as soon as another process is busy.
* ``VLLM_CPU_OMP_THREADS_BIND=nobind``: otherwise vLLM's multi-process launcher sets the
  Worker's ``OMP_NUM_THREADS`` to the number of cores it binds (all of them).
* ``TORCH_COMPILE_DISABLE=1``: the logprobs path is ``torch.compile``d; the first compile
  takes 10-18 s.
* ``VLLM_ENABLE_V1_MULTIPROCESSING`` is *not* set here: each test chooses its mode, and
  vLLM reads it when an engine is built.

The tiny model is a random Llama built offline (no hub, no network) with a fixed seed: 2
layers, hidden 128, 4 attention heads, 2 KV heads (head_dim 32, one of the CPU attention
backend's sizes), vocab 512, with a word-level tokenizer whose words ``w0 .. w507`` are one
token each, so prompt lengths in tokens are exact.
"""

from __future__ import annotations

import enum
import gc
import importlib.util
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tiny_llama as tiny_llama_example  # examples/ (pytest pythonpath)


def _vllm_installed() -> bool:
    """True if the real vLLM is importable (a namespace package, e.g. this folder, is not)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


VLLM_INSTALLED = _vllm_installed()

if VLLM_INSTALLED:
    # Only where vLLM runs: these change the whole pytest process and its children.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Multi-process mode: with the default "auto" vLLM binds the Worker to every core
    # and overrides OMP_NUM_THREADS with their count (2 here); "nobind" keeps it at 1.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    # In case torch was imported (by another test module) before the variable was set.
    torch.set_num_threads(1)

SHUTDOWN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class TinyModel:
    """A tiny random Llama checkpoint and tokenizer in ``path`` (a folder vLLM can load)."""

    path: Path
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @staticmethod
    def prompt(num_tokens: int, start: int = 0) -> str:
        """A prompt of exactly ``num_tokens`` tokens: words ``w{start} ..`` (wrapping)."""
        return tiny_llama_example.prompt(num_tokens, start)


def _build_model(folder: Path, sliding_window: int | None = None) -> TinyModel:
    """The tiny Llama of examples/tiny_llama.py (the one builder), with its tokenizer."""
    tiny_llama_example.build_tokenizer(folder)
    config = tiny_llama_example.build_model(folder, sliding_window)
    return TinyModel(
        path=folder,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        vocab_size=tiny_llama_example.VOCAB_SIZE,
    )


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny random Llama (float32 weights; pass ``dtype="bfloat16"`` to vLLM for bf16)."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    return _build_model(folder)


@pytest.fixture(scope="session")
def tiny_hybrid_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """The tiny Llama with a 64-token sliding-window layer 0 (two KV cache groups)."""
    folder = tmp_path_factory.mktemp("tiny_hybrid_llama")
    return _build_model(folder, sliding_window=64)


@pytest.fixture
def repo_on_pythonpath() -> Iterator[str]:
    """Put the repository root on ``PYTHONPATH`` in the environment for the test.

    Spawned vLLM processes (EngineCore, Worker) import the connector module by its
    dotted path themselves; the CPU platform forces ``spawn``, so ``sys.path`` is not
    inherited, only the environment.
    """
    root = str(Path(__file__).resolve().parents[2])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = root if not old else f"{root}{os.pathsep}{old}"
    try:
        yield root
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


class EngineMode(enum.Enum):
    """How vLLM runs its engine (the value of ``VLLM_ENABLE_V1_MULTIPROCESSING``)."""

    IN_PROCESS = "0"  # scheduler and worker in the test process
    MULTI_PROCESS = "1"  # EngineCore process (scheduler) + Worker process, both spawned


@dataclass(frozen=True)
class EngineSpec:
    """What to build: the tiny model with a connector loaded by module path."""

    mode: EngineMode
    connector: str  # class name in ``module``
    module: str = "tests.vllm.null_connector"
    dtype: str = "float32"
    extra_config: tuple[tuple[str, Any], ...] = ()
    kv_cache_bytes: int = 16 << 20
    max_num_seqs: int = 8
    # Overrides of KVTransferConfig fields and of LLM() arguments (bad-config tests, TP).
    kv_overrides: tuple[tuple[str, Any], ...] = ()
    llm_overrides: tuple[tuple[str, Any], ...] = ()


# llm_factory(connector, *, multiprocess=False, dtype="float32", module=..., **extra_config)
LLMFactory = Callable[..., AbstractContextManager[Any]]


def _children_alive() -> list[int]:
    """Child processes still running: not zombies, not multiprocessing's resource tracker
    (started on the first spawn, it lives as long as this process by design)."""
    psutil = importlib.import_module("psutil")

    alive = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if "multiprocessing.resource_tracker" in " ".join(proc.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        alive.append(proc.pid)
    return alive


def drain_in_process(llm: Any, max_steps: int = 64) -> int:
    """Step an in-process engine while its scheduler has work; return the steps taken.

    ``LLM.generate`` stops stepping once its own requests are done, so in in-process
    mode the step that tells the workers which requests finished, and any steps a
    connector asks for with ``has_pending_push_work``, run only at the next
    ``generate``, after that call's lookups. This runs them now (in multi-process mode
    the EngineCore's busy loop does it by itself).
    """
    core = llm.llm_engine.engine_core.engine_core
    steps = 0
    while core.scheduler.has_requests():
        assert steps < max_steps, "engine still has work after max_steps steps"
        _, executed = core.step_fn()
        core.post_step(model_executed=executed)
        steps += 1
    return steps


@contextmanager
def _run_llm(model: TinyModel, spec: EngineSpec) -> Iterator[Any]:
    """Build an ``LLM`` for ``spec``; shut it down and check no child process is left."""
    import torch
    import vllm.envs
    from vllm import LLM
    from vllm.config import KVTransferConfig

    # vLLM's CPU worker replaces torch.set_num_threads with a no-op (in-process mode:
    # in this process, for the rest of the session); put it back afterwards.
    set_num_threads = torch.set_num_threads

    old_mode = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = spec.mode.value
    # An in-process EngineCore freezes vLLM's env lookups (enable_envs_cache), so a later
    # engine in this process would not see the mode chosen above without this.
    vllm.envs.disable_envs_cache()
    kv_args: dict[str, Any] = {
        "kv_connector": spec.connector,
        "kv_connector_module_path": spec.module,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(spec.extra_config),
    }
    kv_args.update(spec.kv_overrides)
    llm_args: dict[str, Any] = {
        "model": str(model.path),
        "enforce_eager": True,
        "dtype": spec.dtype,
        "max_model_len": 2048,
        "enable_prefix_caching": True,
        "block_size": 32,
        "max_num_seqs": spec.max_num_seqs,
        "seed": tiny_llama_example.SEED,
        "kv_cache_memory_bytes": spec.kv_cache_bytes,
    }
    llm_args.update(spec.llm_overrides)
    llm = None
    try:
        llm = LLM(**llm_args, kv_transfer_config=KVTransferConfig(**kv_args))
        yield llm
    finally:
        if llm is not None:
            # The default 5 s is too short in multi-process mode: the Worker spends ~5 s
            # exiting, the EngineCore is then SIGKILLed and left a zombie. Graceful: ~8 s.
            llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
            del llm
        elif spec.mode is EngineMode.IN_PROCESS:
            # A start that failed after the worker-side connector was created leaves it
            # in vLLM's process-global slot, where the next engine would pick it up.
            from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

            ensure_kv_transfer_shutdown()
        if old_mode is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old_mode
        vllm.envs.disable_envs_cache()
        torch.set_num_threads = set_num_threads
        # The in-process EngineCore gc.freeze()s the heap after start-up.
        gc.unfreeze()
        gc.collect()
        deadline = time.monotonic() + 15.0
        while _children_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _children_alive()
        assert not left, f"vLLM left child processes running: {left}"


@pytest.fixture
def llm_factory(tiny_llama: TinyModel, repo_on_pythonpath: str) -> LLMFactory:
    """``with llm_factory("NullConnector", multiprocess=True, log_path=...) as llm:``.

    Builds one engine with the tiny model and the named connector class (from ``module``,
    default ``tests.vllm.null_connector``); keyword arguments other than ``multiprocess``,
    ``dtype`` and ``module`` go to ``kv_connector_extra_config``. On exit the engine is
    shut down and the test fails if a child process is left.
    """

    def factory(
        connector: str,
        *,
        multiprocess: bool = False,
        dtype: str = "float32",
        module: str = "tests.vllm.null_connector",
        **extra_config: Any,
    ) -> AbstractContextManager[Any]:
        spec = EngineSpec(
            mode=EngineMode.MULTI_PROCESS if multiprocess else EngineMode.IN_PROCESS,
            connector=connector,
            module=module,
            dtype=dtype,
            extra_config=tuple(sorted(extra_config.items())),
        )
        return _run_llm(tiny_llama, spec)

    return factory


@contextmanager
def _spawn_path() -> Iterator[str]:
    """The repository root on ``PYTHONPATH`` while the block runs (see
    ``repo_on_pythonpath``)."""
    root = str(Path(__file__).resolve().parents[2])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = root if not old else f"{root}{os.pathsep}{old}"
    try:
        yield root
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


@contextmanager
def _run_llm_on_path(model: TinyModel, spec: EngineSpec) -> Iterator[Any]:
    with _spawn_path(), _run_llm(model, spec) as llm:
        yield llm


@pytest.fixture(scope="session")
def make_llm(tiny_llama: TinyModel) -> LLMFactory:
    """Session-scoped ``llm_factory`` for module-scoped engines (one engine shared by a
    module's tests): ``make_llm(connector, *, module, multiprocess=False,
    dtype="float32", kv_cache_bytes=16 << 20, max_num_seqs=8, kv_overrides=None,
    llm_overrides=None, **extra_config)``; ``kv_overrides`` replace KVTransferConfig
    arguments, ``llm_overrides`` LLM() arguments."""
    return _session_factory(tiny_llama)


@pytest.fixture(scope="session")
def make_hybrid_llm(tiny_hybrid_llama: TinyModel) -> LLMFactory:
    """``make_llm`` for the tiny hybrid (sliding-window + full attention) Llama."""
    return _session_factory(tiny_hybrid_llama)


def _session_factory(tiny_llama: TinyModel) -> LLMFactory:
    def factory(
        connector: str,
        *,
        module: str,
        multiprocess: bool = False,
        dtype: str = "float32",
        kv_cache_bytes: int = 16 << 20,
        max_num_seqs: int = 8,
        kv_overrides: dict[str, Any] | None = None,
        llm_overrides: dict[str, Any] | None = None,
        **extra_config: Any,
    ) -> AbstractContextManager[Any]:
        spec = EngineSpec(
            mode=EngineMode.MULTI_PROCESS if multiprocess else EngineMode.IN_PROCESS,
            connector=connector,
            module=module,
            dtype=dtype,
            extra_config=tuple(sorted(extra_config.items())),
            kv_cache_bytes=kv_cache_bytes,
            max_num_seqs=max_num_seqs,
            kv_overrides=tuple(sorted((kv_overrides or {}).items())),
            llm_overrides=tuple(sorted((llm_overrides or {}).items())),
        )
        return _run_llm_on_path(tiny_llama, spec)

    return factory


@pytest.fixture
def drain() -> Callable[[Any], int]:
    """``drain_in_process``: run the steps an in-process engine still owes (see there)."""
    return drain_in_process


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under this directory ``vllm``."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
