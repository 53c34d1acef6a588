"""vLLM plugin: register realscale's ``gloo`` and ``gloo_m2n`` weight-transfer engines with vLLM.

setup.py names :func:`register` under the ``vllm.general_plugins`` entry-point group, which
vLLM loads in every process it starts (API server, engine core, each worker), so a
server started with ``--weight-transfer-config '{"backend": "gloo"}'`` finds the engine.
The trainer process calls :func:`register` itself before asking vLLM's trainer factory
for the engine. Registration is by module path: nothing heavy is imported until vLLM
creates the engine, and registering twice is harmless.
"""

from __future__ import annotations

ENGINE_MODULE = "realscale.inference.vllm_gloo"
M2N_MODULE = "realscale.inference.vllm_m2n"  # the twin of vLLM's shard-to-shard nccl_m2n

ENGINES = (("gloo", ENGINE_MODULE, "GlooWeightTransferEngine", "GlooTrainerWeightTransferEngine"),
           ("gloo_m2n", M2N_MODULE, "GlooM2NWeightTransferEngine", "GlooM2NTrainerWeightTransferEngine"))


def register() -> None:
    """Add ``gloo`` and ``gloo_m2n`` to vLLM's worker-side and trainer-side weight-transfer factories."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for name, module, worker_cls, trainer_cls in ENGINES:
        for factory, cls in ((WeightTransferEngineFactory, worker_cls), (WeightTransferTrainerFactory, trainer_cls)):
            if name not in factory._registry:  # vLLM's registry raises on a second registration
                factory.register_engine(name, module, cls)
