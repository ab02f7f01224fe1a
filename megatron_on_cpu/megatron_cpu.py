"""Running megatron-core's real model, DDP and DistributedOptimizer on CPU with gloo.

Test and example support, not part of the installed packages: the multi-process tests, the
main job (examples/gpt_cpu) and the convergence study (bench/convergence.py) put this
directory on their path. GPU jobs need none of it.

megatron-core assumes CUDA in a few places even when every tensor it is given lives on the
CPU. Each shim below answers one such assumption and names the megatron-core lines that need
it (0.16.1 / 0.19.2). :func:`install` applies, process-wide, the shims the installed
megatron-core needs, detected from its sources (a shim whose call is absent is left out);
:func:`cuda_as_cpu` is the scoped one, entered around the optimizer's construction, its
``step()`` and checkpoint calls, a pipeline schedule's step and the construction of a model
whose word embedding is tied across pipeline stages. What the caller does besides
(docs/megatron.md, "Running on CPU"): ``TransformerConfig(use_cpu_initialization=True)``, the
model wrapped in ``Float16Module`` as Megatron-LM wraps it, an explicit causal attention mask,
``model_parallel_cuda_manual_seed`` after :func:`install` (it seeds the CPU tracker), and
``OptimizerConfig(loss_scale=...)`` where the found-inf check is wanted (bf16 without a loss
scale has no grad scaler, hence no check).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class Shim:
    """One process-wide replacement: `needed_by` names the megatron-core calls it answers,
    `call` the source text of the call looked for in `function` (``module:qualified.name``)."""

    name: str
    needed_by: str
    function: str
    call: str
    apply: Callable[[], None]

    def needed(self) -> bool:
        """Whether the installed megatron-core makes the call this shim answers."""
        module_name, qualname = self.function.split(":")
        target = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part, None)
            if target is None:
                return False
        return self.call in inspect.getsource(target)


class HostStream:
    """What megatron-core asks of ``torch.cuda.current_stream()`` before a gradient sync: on
    the CPU there is no stream, so there is nothing to wait for."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def _cpu_tracker_class():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CpuRNGStatesTracker(CudaRNGStatesTracker):
        """megatron-core's RNG-states tracker over the CPU generator: named states seeded by
        ``model_parallel_cuda_manual_seed`` and forked around dropout, as the CUDA tracker
        does with the CUDA generator (which does not exist here)."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"RNG state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise ValueError(f"RNG state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


def _cpu_current_device() -> None:
    torch.cuda.current_device = lambda: "cpu"


def _host_stream() -> None:
    torch.cuda.current_stream = lambda device=None: HostStream()


def _host_side_streams() -> None:
    torch.cuda.Stream = lambda *args, **kwargs: HostStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.default_stream = lambda device=None: HostStream()


def _no_synchronize() -> None:
    torch.cuda.synchronize = lambda device=None: None


def _cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random

    random._CUDA_RNG_STATE_TRACKER = _cpu_tracker_class()()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


SHIMS = (
    Shim("current_device",
         "buffers and optimizer state allocated on torch.cuda.current_device(): "
         "distributed/param_and_grad_buffer.py:783,800,806 / 1162,1180,1186; "
         "optimizer/distrib_optimizer.py:791 / 998",
         "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer.__init__",
         "torch.cuda.current_device()", _cpu_current_device),
    Shim("current_stream",
         "start_grad_sync waits on torch.cuda.current_stream() for CUDA-graph gradient events: "
         "- / distributed/param_and_grad_buffer.py:632 (0.19 only)",
         "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup.start_grad_sync",
         "torch.cuda.current_stream()", _host_stream),
    Shim("side_streams",
         "with several distributed-optimizer instances DDP makes a communication stream "
         "(distributed/distributed_data_parallel.py:230 / 297), which the gradient sync enters "
         "and joins to the compute stream (distributed/param_and_grad_buffer.py:417,422,529 / "
         "686,691,814): on the CPU a collective has completed when it returns, so there is "
         "nothing to order",
         "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel.__init__",
         "torch.cuda.Stream(", _host_side_streams),
    Shim("rng_tracker",
         "attention dropout always forks the CUDA RNG tracker: "
         "transformer/dot_product_attention.py:217 / 217, whose states are CUDA generator "
         "states (tensor_parallel/random.py:235-238 / 303-306)",
         "megatron.core.transformer.dot_product_attention:DotProductAttention.forward",
         "get_cuda_rng_tracker().fork()", _cpu_rng_tracker),
    Shim("synchronize",
         "checkpoint saving synchronizes the device after staging tensors: "
         "dist_checkpointing/strategies/filesystem_async.py:230 / 248; so do the pipeline's "
         "batched sends and receives: pipeline_parallel/p2p_communication.py:398 / 419",
         "megatron.core.dist_checkpointing.strategies.filesystem_async:"
         "FileSystemWriterAsync.preload_tensors",
         "torch.cuda.synchronize()", _no_synchronize),
)

_INSTALLED: list[str] = []


def install() -> list[str]:
    """Applies the shims the installed megatron-core needs (idempotent); returns their names.
    Refuses on a machine with CUDA, where megatron-core runs as it is."""
    if torch.cuda.is_available():
        raise RuntimeError("megatron_cpu is for CPU-only runs; CUDA is available here")
    if not _INSTALLED:
        for shim in SHIMS:
            if shim.needed():
                shim.apply()
                _INSTALLED.append(shim.name)
    return list(_INSTALLED)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaAsCpu(TorchFunctionMode):
    """Inside this mode, CUDA requests stay on the CPU:

    - ``device='cuda'`` (a string, ``torch.device`` or an index) in any torch call becomes the
      CPU: the found-inf flag, loss scale and overflow buffers of the mixed-precision optimizer
      (optimizer/optimizer.py:473,481,485 / 690,698,702; optimizer/grad_scaler.py:15 / 20),
      the gradient-norm and zero-count scratch tensors (optimizer/clip_grads.py:90,103,115,
      174,207 / 96,108,112,180,231; utils.py:1207 / 1332), the pipeline schedules' token
      counter (pipeline_parallel/schedules.py:2138 / 2292 in 1F1B);
    - ``Tensor.cuda()`` and ``Tensor.to('cuda')`` return the tensor where it is: gathering
      optimizer state for the fully reshardable checkpoint formats
      (optimizer/distrib_optimizer.py:1089 / 1374), the last pipeline stage's copy of the
      tied word embedding before it is all-reduced from the first
      (models/common/language_module/language_module.py:244 / 307);
    - ``Tensor.type()`` answers the ``torch.cuda.*`` name of the tensor's dtype, as the
      optimizer's parameter-type checks expect (optimizer/distrib_optimizer.py:361,420,582 /
      401,466,758; optimizer/optimizer.py:671,690 / 1009,1028; optimizer/clip_grads.py:167 /
      174).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None:
                return name
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_as_cpu():
    """The scoped shim (see :class:`_CudaAsCpu`): enter it around ``get_megatron_optimizer``,
    ``optimizer.step()``, the optimizer's (sharded) state-dict calls,
    ``dist_checkpointing.save`` / ``load``, a pipeline schedule's step and building a model
    whose embedding is tied across pipeline stages. Scoped rather than process-wide because it
    answers ``Tensor.type()`` with a CUDA name, which only those calls should see."""
    with _CudaAsCpu():
        yield
