"""The ASAG controller: greedy (optionally sampled) decoding inside the thinking block, and at every
action-transition point (ATP) a probe for the intermediate answer, the windowed attention entropy and the trap test,
which pick exit, logit injection, jump prompt or continue.

One code path for the tiny Llama and any local HF decoder: a DynamicCache that probes roll back
(`crop`), and forward hooks on the last attention modules that reduce each query row to what the
controller needs as the row is produced, so no attention matrix is ever kept.
"""
from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass, field

import torch

from icml.cli.errors import UsageError
from icml.methods.reason_stop.data import extract_answer, normalise_answer, read_answer

EXIT, FORCED_EXIT, INJECT, JUMP, CONTINUE = "exit", "forced_exit", "inject", "jump", "continue"
ACTIONS = (EXIT, FORCED_EXIT, INJECT, JUMP, CONTINUE)


@dataclass(frozen=True)
class Policy:
    """What a variant does at an ATP."""

    rule: str  # none (never probes) | deer | asag | oracle
    inject: bool = False
    jump: bool = False
    nothinking: bool = False

    @property
    def probes(self) -> bool:
        return self.rule != "none"


POLICIES = {
    "vanilla": Policy("none"),
    "nothinking": Policy("none", nothinking=True),
    "deer": Policy("deer"),
    "asag": Policy("asag", inject=True, jump=True),
    "asag_exit": Policy("asag"),
    "asag_exit_inject": Policy("asag", inject=True),
    "asag_exit_jump": Policy("asag", jump=True),
    "oracle_first_correct": Policy("oracle"),
}


# ---------------------------------------------------------------------------------------------
# The quantities of the method
# ---------------------------------------------------------------------------------------------
def normalised_entropy(weights: torch.Tensor, key_counts: torch.Tensor) -> torch.Tensor:
    """[−Σ_j A[r,j] log A[r,j]] / log k_r for attention rows `weights` [..., rows, keys] whose row r
    sees k_r keys (the rest carry weight 0, and 0·log 0 = 0). Uniform over k_r keys → 1, one-hot → 0.
    Without the log k normalisation entropy grows with the context and ΔH turns positive by itself.
    A row that sees one key has entropy 0 whatever the normalisation: it is 0."""
    entropy = -torch.special.xlogy(weights, weights).sum(-1)
    return entropy / torch.log(key_counts.to(entropy.dtype).clamp(min=2))


def relative_change(h: float, h_first: float) -> float:
    """ΔH_i = (H_i − H_1) / H_1."""
    return (h - h_first) / h_first if h_first else math.nan


def injected(probs: torch.Tensor, reference: torch.Tensor | None, weight: float) -> torch.Tensor:
    """p = (1−γ)·softmax(z) + γ·r: a mixture of probabilities (never of logits), so it sums to 1."""
    return probs if reference is None else (1 - weight) * probs + weight * reference


def answer_distribution(answer_ids: list[int], probs: list[float], vocab_size: int) -> torch.Tensor | None:
    """r_v ∝ Σ_k p(a_k)·[v = a_k], normalised to 1 (None for an empty intermediate answer)."""
    if not answer_ids:
        return None
    r = torch.zeros(vocab_size, dtype=torch.float64)
    r.index_add_(0, torch.tensor(answer_ids), torch.tensor(probs, dtype=torch.float64))
    return r / r.sum()


def decide(i: int, confidence: float, delta_h: float, trapped: bool, jumps_used: int, policy: Policy, *,
           lam: float, alpha: float, max_jumps: int, correct: bool = False) -> str:
    """The action at ATP i (1-based)."""
    if policy.rule == "none":
        return CONTINUE
    if policy.rule == "oracle":  # a reference that reads the label: exit at the first correct probe
        return EXIT if correct else CONTINUE
    if policy.rule == "deer" or i == 1:  # DEER everywhere, ASAG at the first ATP: no entropy gate
        return EXIT if confidence > lam else CONTINUE
    if delta_h < alpha:
        if confidence > lam:
            return EXIT
        return INJECT if policy.inject else CONTINUE
    if trapped and policy.jump:
        return JUMP if jumps_used < max_jumps else FORCED_EXIT
    return CONTINUE


# ---------------------------------------------------------------------------------------------
# Attention rows
# ---------------------------------------------------------------------------------------------
def decoder_layers(model):
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise UsageError(f"{type(model).__name__} has no model.layers decoder stack",
                         "use a decoder-only causal LM (Llama, Qwen2/3, Mistral, DeepSeek-R1-Distill)")
    return layers


class AttentionRecorder:
    """Forward hooks on the last `n_last` attention modules. Each query row at position p (batch 1,
    causal, no padding: it sees keys 0…p) is reduced at once to
    - its normalised entropy per (layer, head): `entropy[p]` [n_last, heads];
    - with Ā its attention averaged over heads and layers: the mean and total weight on the keys
      of the previous action [prev_start, cur_start) and on its own action's visible keys
      [cur_start, p] (`bounds` is set by the controller at every ATP; NaN outside actions).
    While `active` is false (probes, the answer phase) nothing is recorded."""

    def __init__(self, model, n_last: int):
        layers = decoder_layers(model)
        if len(layers) < n_last:
            raise UsageError(f"the model has {len(layers)} layers, fewer than n_last_layers={n_last}",
                             "lower n_last_layers with --set")
        self.n_last = n_last
        self.active = True
        self.bounds: tuple[int | None, int | None] = (None, None)
        self.handles = [layer.self_attn.register_forward_hook(self._hook) for layer in layers[-n_last:]]
        self.reset()

    def reset(self) -> None:
        self.entropy: list[torch.Tensor] = []
        self.trap: list[tuple[float, float, float, float]] = []  # (prev mean, prev mass, self mean, self mass)
        self._rows: list[torch.Tensor] = []
        self._mean_rows: torch.Tensor | None = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _hook(self, module, args, output) -> None:
        if not self.active:
            return
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if weights is None:
            raise UsageError("the attention modules return no attention weights (SDPA/flash attention)",
                             "load the model with attn_implementation='eager'")
        w = weights[0].detach()  # [heads, q, k]
        w = w.to(torch.promote_types(w.dtype, torch.float32))  # half-precision models: reduce in fp32
        q, k = w.shape[-2:]
        counts = torch.arange(k - q + 1, k + 1, device=w.device)
        self._rows.append(normalised_entropy(w, counts).T)  # [q, heads]
        mean = w.mean(0)
        self._mean_rows = mean if self._mean_rows is None else self._mean_rows + mean

    def commit(self, start: int) -> None:
        """File the rows of the forward that covered positions start…start+q−1."""
        if not self.active:
            return
        if len(self._rows) != self.n_last or start != len(self.entropy):
            raise RuntimeError(f"attention rows out of step ({len(self._rows)} layers, row {start} after "
                               f"{len(self.entropy)})")
        per_row = torch.stack(self._rows, 1).cpu()  # [q, n_last, heads]
        a_bar = (self._mean_rows / self.n_last).cpu()  # Ā [q, k]
        prev_start, cur_start = self.bounds
        for offset in range(per_row.shape[0]):
            p = start + offset
            self.entropy.append(per_row[offset])
            if cur_start is None or p < cur_start:
                self.trap.append((math.nan,) * 4)
                continue
            own = a_bar[offset, cur_start:p + 1]
            if prev_start is None:
                prev_mean = prev_mass = math.nan
            else:
                prev = a_bar[offset, prev_start:cur_start]
                prev_mass = float(prev.sum())
                prev_mean = prev_mass / max(1, prev.numel())
            self.trap.append((prev_mean, prev_mass, float(own.mean()), float(own.sum())))
        self._rows, self._mean_rows = [], None

    def discard(self) -> None:
        self._rows, self._mean_rows = [], None

    def truncate(self, length: int) -> None:
        del self.entropy[length:]
        del self.trap[length:]

    def window_entropy(self, start: int, end: int, window: int) -> float:
        """H_i = Σ_{l,h} (1/|W|) Σ_{r∈W} H_{l,h}[r] over W = the last `window` rows of [start, end)
        (the row before `end` alone if the action is empty)."""
        rows = self.entropy[max(start, end - window):end] or self.entropy[end - 1:end]
        return float(torch.stack(rows).mean(0).sum())

    def trap_stats(self, start: int, end: int, stat: str) -> tuple[float, float]:
        """(a_prev, a_self) averaged over the rows of the action [start, end)."""
        rows = self.trap[start:end]
        if not rows:
            return math.nan, math.nan
        pick = (0, 2) if stat == "mean" else (1, 3)
        return tuple(sum(r[j] for r in rows) / len(rows) for j in pick)


# ---------------------------------------------------------------------------------------------
# Text ↔ ids of one model
# ---------------------------------------------------------------------------------------------
def spells(tokenizer, word: str) -> bool:
    """Whether the tokenizer can write `word` at all (alone or after a space, as BPE vocabularies
    store it): a word that encodes to `<unk>` could never be generated, so never trigger."""
    return any(tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]).strip() == word
               for text in (word, " " + word))


class Codec:
    """The tokenizer side of the controller: prompts, controller strings, per-token words."""

    def __init__(self, tokenizer, model, cfg):
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.template = bool(getattr(tokenizer, "chat_template", None))
        self.boxed = cfg.data is not None  # problems of a --data file: answers from the last \boxed{}
        self.atp_words = {w.strip() for w in cfg.atp_words}
        self.longest_atp = max(len(w.encode()) for w in self.atp_words)  # a token holds >= 1 byte of a word
        self.think_end = cfg.think_end.strip()
        self.terminator = cfg.probe_terminator.strip()
        eos = {tokenizer.eos_token_id}
        generation = getattr(model, "generation_config", None)
        extra = getattr(generation, "eos_token_id", None)
        eos |= set(extra) if isinstance(extra, (list, tuple)) else {extra}
        self.eos = {e for e in eos if e is not None}
        self._words: dict[int, str] = {}
        self.probe_ids = self.encode(cfg.probe_string)
        self.exit_ids = self.encode(cfg.exit_suffix)
        self.jump_ids = self.encode(cfg.jump_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def word(self, token: int) -> str:
        """The decoded token stripped of whitespace ("Wait" and " Wait" are one ATP word)."""
        if token not in self._words:
            self._words[token] = self.tokenizer.decode([token]).strip()
        return self._words[token]

    def atp_length(self, ids: list[int], start: int, token: int) -> int:
        """How many tokens the ATP word that `token` completes spans, counting back into ids[start:]
        (0: it completes none). A word the tokenizer splits (" Altern" + "atively") is matched on the
        decoded text of the last k tokens: the fewest whose text, stripped of whitespace, is an ATP
        word. The search stops as soon as that text is no longer the end of some ATP word, so an
        ordinary token costs one cached look-up."""
        text = self.word(token)
        for k in range(1, min(len(ids) - start + 1, self.longest_atp) + 1):
            if k > 1:
                text = self.tokenizer.decode(ids[len(ids) - k + 1:] + [token]).strip()
            if text in self.atp_words:
                return k
            if not text or not any(w.endswith(text) for w in self.atp_words):
                return 0
        return 0

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def prompt_ids(self, question: str, nothinking: bool) -> list[int]:
        if self.template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                      add_generation_prompt=True)
        else:
            text = question
        opening = self.cfg.empty_think if nothinking else self.cfg.think_start
        if not text.rstrip().endswith(self.cfg.think_start.strip()) or nothinking:
            text = text + ("" if text.endswith((" ", "\n")) or not text else " ") + opening
        return self.tokenizer(text, add_special_tokens=not self.template)["input_ids"]


# ---------------------------------------------------------------------------------------------
# One generation
# ---------------------------------------------------------------------------------------------
def stream_seed(seed: int, problem_id: int) -> int:
    """The seed of one problem's sampling stream: a function of (run seed, problem id) alone, so every
    variant of a problem draws the same random numbers in the same order."""
    import numpy as np

    return int(np.random.SeedSequence([seed, problem_id]).generate_state(1, np.uint64)[0])


class Decoder:
    """How the model's next token is chosen. Temperature 0 (the spec's): the argmax. Temperature > 0:
    a draw from softmax of the logits warped by HF's own `TemperatureLogitsWarper`/`TopPLogitsWarper`
    with `torch.multinomial`, the steps of `generate(do_sample=True, top_k=0)`, from a generator of
    the problem's own (`stream_seed`). Only the model's own tokens draw — thinking and final answer;
    probes stay greedy and never touch the generator — so a controller that only continues consumes
    vanilla's stream exactly and reproduces vanilla's sampled trace."""

    def __init__(self, cfg, seed: int, problem_id: int, device: str):
        self.sampled = cfg.temperature > 0
        if self.sampled:
            from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

            # as generate(): no temperature warper at T = 1, no nucleus at top_p = 1
            self.warpers = LogitsProcessorList(([TemperatureLogitsWarper(cfg.temperature)] if cfg.temperature != 1
                                                else []) + ([TopPLogitsWarper(cfg.top_p)] if cfg.top_p < 1 else []))
            self.generator = torch.Generator(device).manual_seed(stream_seed(seed, problem_id))

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The next-token probabilities [vocab] the choice is made from."""
        if not self.sampled:
            return logits.softmax(-1)
        return self.warpers(None, logits[None]).softmax(-1)[0]

    def pick(self, probs: torch.Tensor) -> int:
        if not self.sampled:
            return int(probs.argmax())
        return int(torch.multinomial(probs[None], 1, generator=self.generator))

    def next(self, logits: torch.Tensor) -> int:
        """A token straight from the logits (the answer phase: no injection)."""
        return self.pick(self.distribution(logits)) if self.sampled else int(logits.argmax())


def _cache_keyword(model) -> str:
    """transformers ≥ 5.x names the cache argument `cache`, earlier versions `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Session:
    """A sequence with its DynamicCache; `feed` runs tokens through the model, `roll_back` crops."""

    def __init__(self, model, recorder: AttentionRecorder, device: str):
        from transformers import DynamicCache

        self.model, self.recorder, self.device = model, recorder, device
        self.cache = DynamicCache()
        self.keyword = _cache_keyword(model)
        self.ids: list[int] = []

    @property
    def length(self) -> int:
        return len(self.ids)

    @torch.no_grad()
    def feed(self, ids: list[int]) -> torch.Tensor:
        """Append `ids`; return the next-token logits [vocab] after the last of them."""
        start = self.length
        logits = self.forward(ids)
        self.ids += ids
        self.recorder.commit(start)
        return logits

    @torch.no_grad()
    def forward(self, ids: list[int]) -> torch.Tensor:
        """The model on `ids` through the cache (the recorder's hooks take their rows): the next-token logits,
        on the device; `feed` files the rows and the ids."""
        x = torch.tensor([ids], device=self.device)
        try:
            out = self.model(input_ids=x, use_cache=True, **{self.keyword: self.cache})
        except Exception:
            self.recorder.discard()
            raise
        return out.logits[0, -1].float()

    def roll_back(self, length: int) -> None:
        """Drop every position ≥ length from the cache, the ids and the recorded rows."""
        if length < self.length:
            self.cache.crop(length - self.length)  # a negative count: tokens to remove
            del self.ids[length:]
        self.recorder.truncate(length)


@dataclass
class Probe:
    answer: str | None
    confidence: float
    answer_ids: list[int]
    probs: list[float]
    tokens: int  # probe-prompt + probe-answer tokens processed (overhead, never savings)


def probe(session: Session, codec: Codec, cfg, atp_ids: list[int]) -> Probe:
    """At an ATP: record the length, append the probe string (after the ATP word's tokens `atp_ids`
    if probe_position=after), greedy-decode the intermediate answer until `read_answer` finds its
    terminator outside the braces the answer opened (`\\frac{3}{4}}` ends at the last brace, as the
    final answer is read), C = mean of the probabilities of the answer's tokens; then roll the cache
    back to the recorded length."""
    base = session.length
    recorder = session.recorder
    recorder.active = False
    tokens = 0
    text = ""  # the answer read so far
    try:
        prefix = (list(atp_ids) if cfg.probe_position == "after" else []) + codec.probe_ids
        logits = session.feed(prefix)
        tokens += len(prefix)
        answer, probs = [], []
        for _ in range(cfg.probe_max_tokens):
            p = logits.softmax(-1)
            token = int(p.argmax())
            tokens += 1
            if token in codec.eos:
                break
            read, closed = read_answer(codec.decode(answer + [token]), codec.terminator)
            if closed:
                if read.strip() != text.strip():  # "4}}": the answer's last piece rides on the terminator token
                    answer.append(token)
                    probs.append(float(p[token]))
                    text = read
                break
            answer.append(token)
            probs.append(float(p[token]))
            text = read
            logits = session.feed([token])
    finally:
        session.roll_back(base)
        recorder.active = True
    confidence = sum(probs) / len(probs) if probs else 0.0  # no answer, no confidence
    return Probe(normalise_answer(text) if codec.boxed else (text.strip() or None), confidence, answer, probs,
                 tokens)


@dataclass
class Generation:
    variant: str
    problem_id: int
    output_ids: list[int]
    text: str
    answer: str | None
    correct: bool
    n_atp: int
    probe_tokens: int
    wall_time_s: float
    counts: dict[str, int] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # the output text split at the ATPs (generate verb)

    @property
    def tokens(self) -> int:
        """Generated tokens: thinking + injected jump-prompt and suffix tokens + final answer."""
        return len(self.output_ids)


def generate(model, codec: Codec, recorder: AttentionRecorder, question: str, truth: str | None, variant: str,
             cfg, device: str, problem_id: int = 0, seed: int = 0) -> Generation:
    """One problem under a variant's policy: greedy decoding, or sampled with cfg.temperature > 0
    from the stream of (seed, problem_id) (`Decoder`)."""
    policy = POLICIES[variant]
    decoder = Decoder(cfg, seed, problem_id, device)
    started = time.perf_counter()
    recorder.reset()
    recorder.active, recorder.bounds = True, (None, None)
    session = Session(model, recorder, device)
    truth_norm = normalise_answer(truth) if codec.boxed else truth
    logits = session.feed(codec.prompt_ids(question, policy.nothinking))
    n_prompt = session.length
    prev_start, cur_start = None, n_prompt  # the first action starts after <think>
    prev_open, cur_open = 0, 0  # tokens that open an action: its ATP word or the jump prompt
    recorder.bounds = (prev_start, cur_start)
    counts = dict.fromkeys(ACTIONS, 0)
    events: list[dict] = []
    probe_tokens, jumps, h_first = 0, 0, math.nan
    reference, inject_left = None, None  # the injected distribution r and the steps it has left
    tail: list[int] = []  # a final <eos> that needs no forward pass
    free_from = n_prompt  # an ATP word spans generated tokens only: not the prompt, a jump prompt or the last ATP word
    thinking, ended = not policy.nothinking, False
    while thinking and session.length - n_prompt < cfg.max_new_tokens:
        probs = decoder.distribution(logits)
        if reference is not None:
            probs = injected(probs.double(), reference.to(probs.device), cfg.inject_weight)
            if inject_left is not None:
                inject_left -= 1
                reference = None if inject_left == 0 else reference
        token = decoder.pick(probs)
        if token in codec.eos:
            tail, thinking, ended = [token], False, True
            break
        if codec.word(token) == codec.think_end:
            logits = session.feed([token])
            thinking = False
            break
        span = codec.atp_length(session.ids, free_from, token)
        if not span:
            logits = session.feed([token])
            continue
        # an action-transition point: the ATP word's last token is chosen but not yet appended; the
        # word's earlier tokens (a word the tokenizer splits) are taken back out, so the ATP sits
        # where the word starts and the word is handled as one token would be
        i = len(events) + 1
        atp_pos = session.length - (span - 1)
        atp_ids = session.ids[atp_pos:] + [token]
        session.roll_back(atp_pos)
        word = codec.decode(atp_ids).strip()
        entropy = recorder.window_entropy(cur_start, atp_pos, cfg.window)
        a_prev, a_self = recorder.trap_stats(cur_start, atp_pos, cfg.trap_stat)
        trapped = bool(a_prev > a_self)  # NaN (no previous action) compares false
        h_first = entropy if i == 1 else h_first
        delta_h = math.nan if i == 1 else relative_change(entropy, h_first)
        found = probe(session, codec, cfg, atp_ids) if policy.probes else None
        correct = found is not None and found.answer is not None and found.answer == truth_norm
        action = decide(i, found.confidence if found else math.nan, delta_h, trapped, jumps, policy,
                        lam=cfg.lam, alpha=cfg.alpha, max_jumps=cfg.max_jumps, correct=correct)
        counts[action] += 1
        if found is not None:
            probe_tokens += found.tokens
        # a loop: the action just finished repeats the previous one verbatim (after their openings)
        repeats = prev_start is not None and \
            session.ids[prev_start + prev_open:cur_start] == session.ids[cur_start + cur_open:atp_pos]
        events.append({"atp_index": i, "position": atp_pos - n_prompt, "word": word, "repeats_previous": repeats,
                       "confidence": found.confidence if found else math.nan,
                       "probe_answer": found.answer if found else None,
                       "probe_correct": correct if found else None,
                       "entropy_h": entropy, "delta_h": delta_h, "a_prev": a_prev, "a_self": a_self,
                       "trap": trapped, "action": action})
        if action in (EXIT, FORCED_EXIT):
            logits = session.feed(codec.exit_ids)
            thinking = False
            break
        prev_start, cur_start = cur_start, atp_pos  # the ATP (or the jump prompt) opens action i+1
        prev_open, cur_open = cur_open, (len(codec.jump_ids) if action == JUMP else len(atp_ids))
        recorder.bounds = (prev_start, cur_start)
        reference, inject_left = None, None
        if action == JUMP:
            jumps += 1
            logits = session.feed(codec.jump_ids)  # replaces the ATP word: the prompt opens with one
        else:
            for piece in atp_ids:  # one at a time as they were decoded: the same forward passes, now in action i+1
                logits = session.feed([piece])
            if action == INJECT:
                reference = answer_distribution(found.answer_ids, found.probs, logits.shape[-1])
                inject_left = cfg.inject_tokens
        free_from = session.length
    recorder.active = False  # the answer phase has no ATPs and needs no attention rows
    if not ended and not thinking:  # still thinking here: the budget ran out, no answer
        for _ in range(cfg.answer_max_tokens):
            token = decoder.next(logits)
            if token in codec.eos:
                tail = [token]
                break
            logits = session.feed([token])
    output = session.ids[n_prompt:] + tail
    text = codec.decode(output)
    final = text.split(codec.think_end)[-1]
    answer = extract_answer(final, codec.boxed) if (codec.think_end in text or policy.nothinking) else None
    return Generation(variant, problem_id, output, text, answer, answer is not None and answer == truth_norm,
                      len(events), 0 if not policy.probes else probe_tokens, time.perf_counter() - started,
                      counts, events)
