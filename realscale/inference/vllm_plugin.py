"""vLLM plugin: register realscale's ``gloo`` weight-transfer engine with vLLM.

setup.py names :func:`register` under the ``vllm.general_plugins`` entry-point group, which
vLLM loads in every process it starts (API server, engine core, each worker), so a
server started with ``--weight-transfer-config '{"backend": "gloo"}'`` finds the engine.
The trainer process calls :func:`register` itself before asking vLLM's trainer factory
for the engine. Registration is by module path: nothing heavy is imported until vLLM
creates the engine, and registering twice is harmless.
"""

from __future__ import annotations

ENGINE_MODULE = "realscale.inference.vllm_gloo"


def register() -> None:
    """Add ``gloo`` to vLLM's worker-side and trainer-side weight-transfer factories."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in ((WeightTransferEngineFactory, "GlooWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "GlooTrainerWeightTransferEngine")):
        if "gloo" not in factory._registry:  # vLLM's registry raises on a second registration
            factory.register_engine("gloo", ENGINE_MODULE, cls)
