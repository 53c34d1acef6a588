"""Weight publishing: how a new policy version reaches every generation server.

One object, :class:`WeightPublisher`, whose :meth:`~WeightPublisher.publish` is the
protocol (every trainer rank calls it after the optimizer step, in the same order):

1. **pause** (rank 0): the rollout controller stops submitting; the servers pause in
   ``generate.pause_mode`` (abort: in-flight requests return their partial output and the
   workflow resubmits them; retract / in_place: they wait).
2. **move**: the :class:`WeightTransport` moves the weights; every trainer rank takes
   part (exports and reshards are collectives). The transport tags the new weights with
   the new version on the servers only once all of them have arrived, so no token is
   ever labelled with a version whose weights are half loaded.
3. **version** (rank 0): the controller's staleness accounting moves to the new version.
4. **resume** (rank 0): servers, then the controller.

Transports (how step 2 happens) are chosen by :func:`transport_for` from the config:

- :class:`ReshardTransport` — the embedded servers: one *weight world* (every trainer
  rank and every server rank, :mod:`realscale.publish.weight_world`), and each step the
  resharder moves each server rank exactly its Megatron-layout shard, straight from the
  trainer ranks that hold it (no funnel through rank 0; on GPUs device to device).
- :class:`BroadcastTransport` — SGLang's ``/update_weights_from_distributed``: HF-named
  full tensors gathered over TP and broadcast to every server rank; from a pipelined
  trainer one weight group per stage, each stage's first rank sending its own part
  (:class:`~realscale.publish.broadcast.StageBroadcastTransport`), nothing through rank 0.
- :class:`VllmEngineTransport` — vLLM servers: vLLM's own trainer-side weight-transfer
  engine (``nccl`` on GPUs, realscale's ``gloo`` on CPU: :mod:`realscale.inference.vllm_gloo`)
  over every rank of every server.
- :class:`DiskTransport` — an HF directory on shared storage, then
  ``/update_weights_from_disk`` (vLLM: ``reload_weights``) (the fallback; any server).

Only rank 0 talks to the servers. It does so through a :class:`ServerControl` (its own
HTTP client and event loop, and the rollout controller's pause / version / resume); the
other ranks get ``None``.
"""
