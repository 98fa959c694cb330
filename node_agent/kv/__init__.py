"""KV migration on every rank, engine-agnostic (torch only; no vLLM).

Given this rank's per-layer KV tensors in the old topology and the plan from
:func:`remp.kvplan.migration_plan`, it builds this rank's per-layer tensors of the new topology,
layer by layer: for global layer ℓ the new owners allocate the new layer, every slice is moved
(worker-to-worker through the transport, or copied locally), then the old layer is released. The
peak extra memory is therefore about one layer (the new layer allocated before the old one is
released, plus the staging buffer of that layer's rounds; by default the two together stay within one
full layer's KV + 10 %, see :func:`~node_agent.kv.migrate.migrate_kv`).

Two ways to move a slice (see :func:`~node_agent.kv.migrate.migrate_kv`): *staged* (any transport:
gathered into a staging buffer per run of consecutive block ids or by one index op on the tensor's
memory-order view reinterpreted as 16-byte elements, sent, scattered on the receiver) and *direct*
(the transport gives direct access to the peers' layer tensors — ranks on one device here, CUDA-IPC
peer mappings over NVLink on a real host: the receiver pulls every slice of a layer straight from
the source tensors into its new tensor in one pass, one kernel launch per layer, no staging).
:func:`~node_agent.kv.executor_collective.migrate_kv_reference` keeps the first executor (advanced
indexing) as the reference.

KV tensor layout per layer (vLLM CPU, and the GPU flash layout after a permute): dimension 0 is the
block id, dimension 1 the local KV head; whatever follows is moved as is. Only the rows of
``block_ids`` (the blocks holding live or cached tokens) are moved; block ``block_ids[i]`` of the
old pool lands in block ``dst_block_ids[i]`` of the new one (default: the same id), so the new
pool may be compacted and smaller than the old.

Modules: :mod:`~node_agent.kv.migrate` (``migrate_kv``, the entry point), :mod:`~node_agent.kv.plan`
(this rank's layers and staging rounds), :mod:`~node_agent.kv.executor_collective` (the staged
path, and the reference executor), :mod:`~node_agent.kv.executor_direct` (the direct path and its
Triton kernel), :mod:`~node_agent.kv.transport` (how ranks reach each other),
:mod:`~node_agent.kv.common` (the layer loop, id maps, slice views every executor shares) and
:mod:`~node_agent.kv.codec` (the payload of one request's KV that cross-host request migration
sends). Nothing is imported here: the engine's worker processes and the agent import only what
they use.
"""
