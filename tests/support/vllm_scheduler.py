"""vLLM 0.32's own ``Scheduler`` driving ``TierKVConnector``'s two halves in one process, the
way vLLM's ``EngineCore`` and its model runner call them, with CPU KV caches and a stand-in
forward pass: each token it computes writes a pattern of its block's content hash into every
layer's slot, so a page loaded from the sidecar can be told from one computed, and a wrong one
from a right one. What vLLM's scheduler does with the connector's answers (hits, asynchronous
loads, failed loads, frees) is its own code, not our model of it."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tierkv.integrations.vllm.connector import TierKVConnector

BLOCK = 32
NUM_KV_HEADS, HEAD_SIZE = 2, 64
WINDOW = 64  # tokens: a 10-block hit needs the sliding groups' blocks 7 and 8 only
SAMPLED = 7  # every request's one generated token
FULL_LAYERS = ("model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn")
SLIDING_LAYERS = ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn")



def kv_cache_config(*, sliding: bool, num_blocks: int = 200) -> KVCacheConfig:
    """One full-attention group, and with ``sliding`` a sliding-window one beside it (vLLM's
    ``make_kv_cache_config(swa_enabled=True)`` in its connector tests), two layers each."""
    spec: dict[str, Any] = {"block_size": BLOCK, "num_kv_heads": NUM_KV_HEADS,
                            "head_size": HEAD_SIZE, "dtype": torch.bfloat16}
    groups = [KVCacheGroupSpec(list(FULL_LAYERS), FullAttentionSpec(**spec))]
    if sliding:
        groups.append(KVCacheGroupSpec(list(SLIDING_LAYERS),
                                       SlidingWindowSpec(**spec, sliding_window=WINDOW)))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def vllm_config(model: Path, address: str, *, policy: str = "recompute",
                max_num_batched_tokens: int = 4096, prefix_caching: bool = False,
                **extra: Any) -> VllmConfig:
    """vLLM's config of an engine of ``model`` (a local folder) with the connector on
    ``address`` (``extra``: more of its ``kv_connector_extra_config``); vLLM's own prefix
    cache off unless asked (a prompt seen twice then hits the connector, not vLLM)."""
    model_config = ModelConfig(model=str(model), dtype="bfloat16", seed=0,
                               skip_tokenizer_init=True)
    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens, max_model_len=4096,
            enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TierKVConnector", kv_connector_module_path="tierkv.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy=policy,
            kv_connector_extra_config={"address": address, **extra}),
        device_config=DeviceConfig("cpu"),
    )


def request(req_id: str, tokens: list[int]) -> Request:
    """A request of ``tokens`` that generates one token, with vLLM's own block hasher."""
    _init_none_hash()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    return Request(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=params,
                   pooling_params=None, mm_features=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


@functools.cache
def _init_none_hash() -> None:
    """vLLM's NONE_HASH for ``sha256`` (its engines set it at start), once."""
    init_none_hash(sha256)


def pattern(block_hash: bytes | None, position: int, layer: int) -> float:
    """What the stand-in forward writes for the token at ``position`` (in a block of
    ``block_hash``, None for a block not full yet) in ``layer``: small integers, exact in bf16."""
    seed = int.from_bytes(block_hash[:4], "little") if block_hash is not None else 977
    return float((seed + 31 * layer + position % BLOCK) % 251 - 125)


class SchedulerEngine:
    """vLLM's ``Scheduler`` of ``config`` (it builds the scheduler half of the connector) and
    the connector's worker half on CPU caches of every layer of ``kv_config``."""

    def __init__(self, config: VllmConfig, kv_config: KVCacheConfig) -> None:
        config.cache_config.num_gpu_blocks = kv_config.num_blocks
        self.kv_config = kv_config
        self.scheduler = Scheduler(
            vllm_config=config, kv_cache_config=kv_config, log_stats=True,
            structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)
        self.worker = TierKVConnector(config, KVConnectorRole.WORKER, kv_config)
        shape = (kv_config.num_blocks, NUM_KV_HEADS, BLOCK, 2 * HEAD_SIZE)
        self.layers = {name: torch.zeros(shape, dtype=torch.bfloat16)
                       for group in kv_config.kv_cache_groups for name in group.layer_names}
        self.worker.register_kv_caches(self.layers)
        self.outputs: dict[str, Any] = {}  # req_id -> its EngineCoreOutput once finished
        # req_id -> the (layer, block) pages of its prompt that did not hold their pattern
        # when its prompt was complete: loaded wrong, or not loaded and not recomputed.
        self.wrong: dict[str, list[tuple[str, int]]] = {}
        self.admitted: list[tuple[str, int]] = []  # (req_id, tokens computed) as scheduled new

    @property
    def connector(self) -> TierKVConnector:
        """The scheduler half (vLLM made it)."""
        connector = self.scheduler.connector
        assert isinstance(connector, TierKVConnector)
        return connector

    def add(self, req: Request) -> Request:
        self.scheduler.add_request(req)
        return req

    def step(self, before_load: Callable[[SchedulerOutput], None] | None = None
             ) -> SchedulerOutput:
        """One engine step: schedule, the worker's calls around the stand-in forward (after
        ``before_load``, a fault's moment: between the lookups and the loads), the output back
        to the scheduler."""
        out = self.scheduler.schedule()
        self.admitted += [(new.req_id, new.num_computed_tokens) for new in out.scheduled_new_reqs]
        worker = self.worker
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.handle_preemptions(out.kv_connector_metadata)
        if before_load is not None:
            before_load(out)
        worker.start_load_kv(None)  # type: ignore[arg-type]
        for name in self.layers:
            worker.wait_for_layer_load(name)
        sampled = self._forward(out)
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        kv_output = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_stats=worker.get_kv_connector_stats())
        worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in req_ids], logprobs=None,
            prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv_output)
        for outputs in self.scheduler.update_from_output(out, runner_output).values():
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    self.outputs[output.request_id] = output
        return out

    def run(self, *req_ids: str, before_load: Callable[[SchedulerOutput], None] | None = None,
            timeout_s: float = 60.0) -> None:
        """Steps until every request of ``req_ids`` finished (``before_load`` at each)."""
        deadline = time.monotonic() + timeout_s
        while not all(r in self.outputs for r in req_ids):
            assert time.monotonic() < deadline, f"requests {req_ids} did not finish"
            out = self.step(before_load)
            if not out.total_num_scheduled_tokens:
                time.sleep(0.002)  # an asynchronous load under way: vLLM spins its steps too

    def _forward(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Write every scheduled token's pattern into its slot of each layer (not into the
        null block: a position out of a window); the sampled token of each request whose
        prompt this step completes."""
        computed = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed |= dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled: dict[str, list[int]] = {}
        for req_id, count in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            start = computed[req_id]
            tables = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            for group, table in zip(self.kv_config.kv_cache_groups, tables, strict=True):
                for position in range(start, start + count):
                    block_id = table[position // BLOCK]
                    if block_id == 0:
                        continue
                    block_hash = self._hash_of(req, position // BLOCK)
                    for name in group.layer_names:
                        value = pattern(block_hash, position, self._layer(name))
                        self.layers[name][block_id, :, position % BLOCK, :] = value
            if start + count >= req.num_tokens:
                sampled[req_id] = [SAMPLED]
                self.wrong[req_id] = self.wrong_pages(req_id, req.num_prompt_tokens // BLOCK)
        return sampled

    def wrong_pages(self, req_id: str, num_blocks: int) -> list[tuple[str, int]]:
        """``(layer, block index)`` of the request's first ``num_blocks`` blocks whose page
        (vLLM's block of it now, not the null block) is not its pattern."""
        req = self.scheduler.requests[req_id]
        tables = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        wrong = []
        for group, table in zip(self.kv_config.kv_cache_groups, tables, strict=True):
            for k in range(num_blocks):
                if table[k] == 0:
                    continue
                for name in group.layer_names:
                    want = torch.tensor([pattern(self._hash_of(req, k), k * BLOCK + s,
                                                 self._layer(name)) for s in range(BLOCK)],
                                        dtype=torch.bfloat16)
                    page = self.layers[name][table[k]]
                    if not torch.equal(page, want.view(1, BLOCK, 1).expand_as(page)):
                        wrong.append((name, k))
        return wrong

    @staticmethod
    def _hash_of(req: Request, index: int) -> bytes | None:
        return bytes(req.block_hashes[index]) if index < len(req.block_hashes) else None

    @staticmethod
    def _layer(name: str) -> int:
        return int(name.split(".")[2])

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()
