"""Generation: SGLang-protocol client, embedded generation server, SGLang launcher.

- :mod:`~realscale.generate.client` ``InferenceClient``: async, many servers, failover,
  interruption-aware ``generate()`` (stitched tokens, log-probs, per-token versions).
- :mod:`~realscale.generate.server` ``EmbeddedServer``: SGLang's native HTTP API on an HF
  model (``realscale serve [--tp N]``); :mod:`~realscale.generate.engine` is its
  continuous-batching scheduler, :mod:`~realscale.generate.ranks` its tensor-parallel
  ranks (collective RPC ``call_all``), :mod:`~realscale.generate.decoder` the KV-slot
  forward pass over Megatron-layout shards and :mod:`~realscale.generate.weights` each
  rank's flat weight buffer.
- :mod:`~realscale.generate.sampling`: sampling and the log-prob convention
  (``LOGPROB_CONVENTION``, ``token_logprobs``) the trainer shares.
- :mod:`~realscale.generate.weight_sync`: ``WeightSender``/``WeightReceiver``, bucketed
  weight broadcast over a separate torch.distributed group (SGLang's protocol).
- :mod:`~realscale.generate.sglang_launcher`: start real SGLang servers (GPU only), after
  checking the installed version.
- :mod:`~realscale.generate.sglang_reference`: the pinned SGLang version and supported range,
  and that version's source (downloaded, not installed) for the contract tests.
"""
