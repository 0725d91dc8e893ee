"""The token world model: a causal LM over visual and action tokens, and its processor.

Two layouts (``action_form``). ``prompt``: the prompt holds K context frames and the
K+F-1 actions up to the last predicted frame; the response is the F future frames'
visual tokens, nothing else::

    <bos> <frame> v(f0) <action> A(a0) <frame> v(f1) ... <frame> v(f[K-1])
          <action> A(a[K-1]) ... <action> A(a[K+F-2]) <frame>          (prompt)
    v(f[K]) v(f[K+1]) ... v(f[K+F-1])                                    (response)

``interleaved`` (RLVR-World's multi-step form): the prompt stops at the action that leads
to the first predicted frame, and the known actions between predicted frames are part of
the response, written by the rollout engine (teacher-forced), not sampled::

    <bos> <frame> v(f0) <action> A(a0) ... <frame> v(f[K-1]) <action> A(a[K-1]) <frame>
    v(f[K]) <action> A(a[K]) <frame> v(f[K+1]) ... <frame> v(f[K+F-1])

so each frame is conditioned on the action that leads to it. The forced tokens carry no
log-prob and no loss (:meth:`TokenWorldModelProcessor.forced_response`).

``v(f)`` is a frame's ``h*w`` visual ids in row-major order and ``A(a)`` one id
per action dimension (see :mod:`mmrl.worldmodel.vocab`). Every response has
exactly :attr:`TokenWorldModelProcessor.response_length` tokens; sampled steps are
constrained to :meth:`TokenWorldModelProcessor.allowed_token_ids`. The model is a transformers
``Qwen2ForCausalLM`` built from config (untied embeddings, head_dim >= 64), so the
transformers and vLLM engines can both serve it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from transformers import PretrainedConfig, Qwen2Config, Qwen2ForCausalLM

from mmrl.worldmodel.tokenizer import VQTokenizer
from mmrl.worldmodel.vocab import ACTION, BOS, EOS, FRAME, PAD, VocabLayout, build_hf_tokenizer

PROCESSOR_FILE = "worldmodel_processor.json"
MIN_HEAD_DIM = 64  # vLLM's CPU attention kernel refused smaller heads
ACTION_FORMS = ("prompt", "interleaved")
FREE = -1  # a response step the engine samples (in forced_response)


@dataclass
class TokenLMConfig:
    """Architecture of the token world model (a Qwen2)."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512


@dataclass
class DecodedResponse:
    """A response read back as VQ codes ``int64 [F, h, w]``, or why it could not be."""

    codes: np.ndarray | None
    valid: bool
    reason: str = ""


class TokenWorldModelProcessor:
    """Builds prompt and response ids for K context frames and F future frames."""

    def __init__(
        self, layout: VocabLayout, context: int, future: int = 1, action_form: str = "prompt"
    ) -> None:
        if context < 1 or future < 1:
            raise ValueError(f"need context >= 1 and future >= 1 frames, found {context}, {future}")
        if action_form not in ACTION_FORMS:
            raise ValueError(f"action_form={action_form!r}; expected one of {list(ACTION_FORMS)}")
        self.layout, self.context, self.future = layout, context, future
        self.action_form = action_form

    @property
    def interleaved(self) -> bool:
        return self.action_form == "interleaved"

    @property
    def prompt_actions(self) -> int:
        """How many actions the prompt holds: K (interleaved) or all K+F-1."""
        return self.context if self.interleaved else self.context + self.future - 1

    @property
    def prompt_length(self) -> int:
        tpf, tpa = self.layout.tokens_per_frame, self.layout.tokens_per_action
        return 1 + self.context * (1 + tpf) + self.prompt_actions * (1 + tpa) + 1

    @property
    def response_length(self) -> int:
        forced = (self.future - 1) * (2 + self.layout.tokens_per_action) if self.interleaved else 0
        return self.future * self.layout.tokens_per_frame + forced

    def response_visual_mask(self) -> np.ndarray:
        """bool [response_length]: the response steps that hold visual tokens (sampled)."""
        tpf, tpa = self.layout.tokens_per_frame, self.layout.tokens_per_action
        gap = 2 + tpa if self.interleaved else 0
        frame = np.r_[np.ones(tpf, bool), np.zeros(gap, bool)]
        return np.tile(frame, self.future)[: self.response_length]

    def frame_end_steps(self) -> np.ndarray:
        """int [F]: the response step of each predicted frame's last visual token."""
        return np.nonzero(self.response_visual_mask())[0][
            self.layout.tokens_per_frame - 1 :: self.layout.tokens_per_frame
        ]

    def allowed_token_ids(self) -> list[int]:
        """The visual ids: the only ids a response may contain."""
        return self.layout.visual_ids()

    def build_prompt(self, context_codes: np.ndarray, actions: np.ndarray) -> list[int]:
        """Prompt ids (1-D, unpadded) from ``context_codes int [K, h, w]`` and ``actions [K+F-1,
        A]``.
        """
        k, n_actions = self.context, self.context + self.future - 1
        n_prompt = self.prompt_actions
        context_codes, actions = np.asarray(context_codes), np.asarray(actions)
        if context_codes.ndim != 3 or len(context_codes) != k:
            raise ValueError(
                f"expected {k} context frames of codes [K, h, w], found {list(context_codes.shape)}"
            )
        if actions.ndim != 2 or len(actions) != n_actions:
            raise ValueError(
                f"expected {n_actions} actions ({k} context + {self.future} future - 1), "
                f"found {list(actions.shape)}"
            )
        frames = self.layout.codes_to_ids(context_codes)
        acts = self.layout.action_to_ids(actions)
        ids = [BOS]
        for t in range(k):
            ids += [FRAME, *frames[t].tolist()]
            if t < k - 1:
                ids += [ACTION, *acts[t].tolist()]
        for t in range(k - 1, n_prompt):
            ids += [ACTION, *acts[t].tolist()]
        ids.append(FRAME)
        return ids

    def build_response(
        self, future_codes: np.ndarray, actions: np.ndarray | None = None
    ) -> list[int]:
        """Response ids from ``future_codes int [F, h, w]`` (and, interleaved, the window's
        ``actions [K+F-1, A]``, whose last F-1 sit between the frames)."""
        future_codes = np.asarray(future_codes)
        if future_codes.ndim != 3 or len(future_codes) != self.future:
            raise ValueError(
                f"expected {self.future} future frames of codes [F, h, w], found "
                f"{list(future_codes.shape)}"
            )
        ids = self.layout.codes_to_ids(future_codes).reshape(self.future, -1)
        if not self.interleaved:
            return ids.reshape(-1).tolist()
        forced = self.forced_response(actions)
        forced[self.response_visual_mask()] = ids.reshape(-1)
        return forced.tolist()

    def forced_response(self, actions: np.ndarray) -> np.ndarray:
        """int64 [response_length]: the token the engine writes at each response step, ``FREE``
        (-1) where it samples. Interleaved: ``<action> A(a) <frame>`` between predicted frames,
        from the window's ``actions [K+F-1, A]``; all ``FREE`` in the prompt form."""
        forced = np.full(self.response_length, FREE, dtype=np.int64)
        if not self.interleaved:
            return forced
        actions = np.asarray(actions)
        n_actions = self.context + self.future - 1
        if actions.ndim != 2 or len(actions) != n_actions:
            raise ValueError(
                f"expected {n_actions} actions [K+F-1, A], found {list(actions.shape)}"
            )
        acts = self.layout.action_to_ids(actions[self.context :])
        gaps = np.nonzero(~self.response_visual_mask())[0].reshape(self.future - 1, -1)
        for gap, act in zip(gaps, acts, strict=True):
            forced[gap] = [ACTION, *act.tolist(), FRAME]
        return forced

    def label_mask(self, prompt: list[int]) -> np.ndarray:
        """bool [len(prompt)]: the visual ids of context frames after the first.

        Pretraining learns these too: each is the next frame after ``<action> A(a) <frame>``,
        just like the response.
        """
        ids = np.asarray(prompt)
        mask = (ids >= self.layout.visual_offset) & (ids < self.layout.action_offset)
        mask[: 2 + self.layout.tokens_per_frame] = False
        return mask

    def decode_response(self, ids: list[int] | np.ndarray) -> DecodedResponse:
        """Read a response (trailing ``<pad>``/``<eos>`` ignored) as codes; never raises on bad
        ids."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        end = len(ids)
        while end and ids[end - 1] in (PAD, EOS):
            end -= 1
        ids = ids[:end]
        if len(ids) != self.response_length:
            what = (
                "response tokens (visual and forced actions)"
                if self.interleaved
                else (f"visual tokens ({self.future} x {self.layout.tokens_per_frame})")
            )
            return DecodedResponse(
                None, False, f"expected {self.response_length} {what}, found {len(ids)}"
            )
        steps = np.nonzero(self.response_visual_mask())[0]
        ids = ids[steps]
        bad = np.nonzero((ids < self.layout.visual_offset) | (ids >= self.layout.action_offset))[0]
        if len(bad):
            return DecodedResponse(
                None,
                False,
                f"token {int(ids[bad[0]])} at position {int(steps[bad[0]])} is not visual",
            )
        codes = (ids - self.layout.visual_offset).reshape(self.future, *self.layout.grid)
        return DecodedResponse(codes, True)

    def decode_frames(
        self, responses: list[list[int]] | list[np.ndarray], tokenizer: VQTokenizer
    ) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """Responses -> ``frames uint8 [B, F, H, W, 3]``, ``valid bool [B]`` and reasons.

        An undecodable response gives black frames, ``valid=False`` and its reason.
        """
        self.check_tokenizer(tokenizer)
        decoded = [self.decode_response(r) for r in responses]
        shape = tokenizer.frame_shape
        frames = np.zeros((len(decoded), self.future, *shape, 3), dtype=np.uint8)
        valid = np.array([d.valid for d in decoded], dtype=bool)
        if valid.any():
            codes = np.concatenate([d.codes for d in decoded if d.valid])
            frames[valid] = tokenizer.decode(codes).reshape(-1, self.future, *shape, 3)
        return frames, valid, [d.reason for d in decoded]

    def check_tokenizer(self, tokenizer: VQTokenizer) -> None:
        """Raise unless ``tokenizer``'s codebook and token grid are the layout's."""
        found = (tokenizer.codebook_size, tokenizer.grid)
        want = (self.layout.codebook_size, self.layout.grid)
        if found != want:
            raise ValueError(
                f"VQ tokenizer has codebook {found[0]} and grid {found[1]}; "
                f"the world model's layout expects codebook {want[0]} and grid {want[1]}"
            )

    def check_model_config(self, config: PretrainedConfig) -> None:
        """Raise unless ``config`` fits this layout (vocab, special ids, length, head size)."""
        problems = []
        if config.vocab_size < self.layout.vocab_size:
            problems.append(f"vocab_size {config.vocab_size} < layout's {self.layout.vocab_size}")
        for name, want in (("pad_token_id", PAD), ("eos_token_id", EOS), ("bos_token_id", BOS)):
            if getattr(config, name, None) != want:
                problems.append(f"{name} is {getattr(config, name, None)}, layout has {want}")
        total = self.prompt_length + self.response_length
        if config.max_position_embeddings < total:
            problems.append(
                f"max_position_embeddings {config.max_position_embeddings} < prompt+response "
                f"{total}"
            )
        head_dim = config.hidden_size // config.num_attention_heads
        if head_dim < MIN_HEAD_DIM:
            problems.append(
                f"head_dim {head_dim} < {MIN_HEAD_DIM} (the vLLM CPU attention kernel needs it)"
            )
        if problems:
            raise ValueError(
                "token world model config does not fit its layout: " + "; ".join(problems)
            )

    def to_json(self) -> dict:
        return {
            "context": self.context,
            "future": self.future,
            "action_form": self.action_form,
            "layout": self.layout.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict) -> TokenWorldModelProcessor:
        return cls(
            VocabLayout.from_json(data["layout"]),
            data["context"],
            data["future"],
            data.get("action_form", "prompt"),  # files written before the interleaved form
        )


def build_token_world_model(
    processor: TokenWorldModelProcessor, cfg: TokenLMConfig
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 over the processor's vocabulary."""
    config = Qwen2Config(
        vocab_size=processor.layout.vocab_size,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
        tie_word_embeddings=False,
        **asdict(cfg),
    )
    processor.check_model_config(config)
    return Qwen2ForCausalLM(config)


def save_token_world_model(
    model: Qwen2ForCausalLM, processor: TokenWorldModelProcessor, path: str | Path
) -> None:
    """``save_pretrained`` of the model and an HF tokenizer, plus the layout and processor JSON."""
    path = Path(path)
    model.save_pretrained(path)
    build_hf_tokenizer(processor.layout).save_pretrained(path)
    processor.layout.save(path)
    (path / PROCESSOR_FILE).write_text(json.dumps(processor.to_json(), indent=1))


def load_token_world_model(path: str | Path) -> tuple[Qwen2ForCausalLM, TokenWorldModelProcessor]:
    """Load a directory written by :func:`save_token_world_model`; checks the two agree."""
    path = Path(path)
    file = path / PROCESSOR_FILE
    if not file.exists():
        raise FileNotFoundError(f"no {PROCESSOR_FILE} in {path}: not a token world model")
    processor = TokenWorldModelProcessor.from_json(json.loads(file.read_text()))
    model = Qwen2ForCausalLM.from_pretrained(path)
    processor.check_model_config(model.config)
    return model, processor
