"""The evaluate stage's settings: the config section `eval` (conf/eval/), typed and checked like
every section, owned by the stage (Stage.settings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from omegaconf import MISSING

from runner.assets.prompts import prompt_set_name
from runner.core.errors import ConfigError
from runner.core.ranges import above, at_least, within
from runner.core.schema import ALL_STAGES

if TYPE_CHECKING:
    from runner.core.schema import RunnerConfig


class Gates(StrEnum):
    fail = "fail"
    warn = "warn"


class SpeedServers(StrEnum):
    # Both evaluation servers up at once, each with half of the memory settings, the timed passes
    # alternating between them: whatever slows the machine for a while slows both.
    together = "together"
    # One server after the other (a target only one server at a time can hold).
    apart = "apart"
    # together where the target's weights take at most a quarter of a GPU, else apart.
    auto = "auto"


class Identity(StrEnum):
    # The target alone reads each served output once, prompt and output prefilled together
    # (vLLM's prompt_logprobs): its greedy choice at every served position in one forward.
    prefill = "prefill"
    # The target alone generates every prompt again, and the two outputs are compared.
    generate = "generate"


# The most draft tokens a step evaluates (eval.num_speculative_tokens): published EAGLE-3 drafts
# are served at k of 3 to 8.
SPECULATIVE_TOKENS_MAX = 32
# The most closed-loop streams a level of eval.concurrency opens (vLLM's default
# max-num-seqs on a GPU is 256 to 1024; the field measures up to 128).
CONCURRENCY_MAX = 1024
# Conversations kept unread for the held-out prompt set when data.hold_out is null.
HELD_OUT_ROOM = 200


@dataclass
class EvalConfig:
    name: str = MISSING
    # Prompt sets, each measured on its own and pooled: "mtbench", "humaneval", or a local .jsonl
    # file with a "prompt" (or "turns") field. The first is the run's objective.
    prompts: list[str] = field(default_factory=lambda: ["mtbench"])
    # At most this many prompts of each set (the first ones, in the set's own order).
    num_prompts: int = 80
    max_new_tokens: int = 128
    num_speculative_tokens: int = 3
    max_model_len: int = 2048
    # A draft folder trained elsewhere (e.g. unpacked by runner.assets.transfer) to evaluate
    # instead of
    # this config's train artifact: `eval.draft=DIR run.stages=[evaluate]`.
    draft: str | None = None
    # The draft to beat, served with the same settings and prompts: a draft folder, a finished
    # run of this output root (run:<run id>), or a hub id (org/name; from the Hugging Face cache,
    # else downloaded). Per set, both acceptance lengths, their paired difference with its 95%
    # interval and a verdict (better, within noise, worse); stages/evaluate/baseline.py.
    baseline_draft: str | None = None
    # The epoch to ship, chosen by serving: each epoch's draft the train stage kept
    # (train.keep_epoch_drafts) is served on the first eval.choose_epoch_prompts prompts of the
    # first set, the best by acceptance length (a tie to the earlier epoch) is evaluated fully
    # and published; acceptance peaks after a few epochs while the loss keeps falling.
    # null: on when train.keep_epoch_drafts is. Each epoch costs a server start.
    choose_epoch: bool | None = None
    choose_epoch_prompts: int = 20
    # Also serve a randomly initialised draft of the same shape, as a floor for comparison.
    random_baseline: bool = False
    # Also serve the target alone: checks greedy output is unchanged and measures the speed ratio.
    compare_target: bool = True
    # How the identity check learns the target's own greedy output (Identity above): prefill
    # reads every served output in one forward each instead of generating it again.
    identity: Identity = Identity.prefill
    # An output served with the draft that leaves the target's greedy path is a near tie (bf16
    # kernels of another batch shape) when the token it took lies within this logprob gap of the
    # target's own choice there; any other fails the identity check. 0.5: bf16 stores a logit of
    # magnitude 32-64 to a spacing of 0.25, and two kernels summing in another order move it by
    # a spacing or two. On one H200 the outputs that diverged did so at gaps of exactly 0 to 0.5
    # in bf16 steps (docs/benchmarks.md); gaps read from fp32 logprobs get 1e-4 of slack
    # (stages/evaluate/measures.py: LOGPROB_ROUNDING).
    near_tie_gap: float = 0.5
    # The speed ratio (draft-served over the target alone), measured on warm servers this many
    # times at concurrency 1 and at the evaluation's batch (the first set's prompts), after one
    # untimed pass; the ratio of the median rates. Each is a steady state: every user (one at
    # concurrency 1, one per prompt at batch) sends its next request as soon as its last is
    # answered, with no round waiting for its slowest request. null = 5 on a GPU, 0 on a CPU
    # (vLLM's CPU build runs speculative decoding slower than the target).
    speed_repeats: int | None = None
    # Prompts (the first set's first ones) generated one after another for concurrency 1.
    speed_prompts: int = 16
    # Each timed pass counts at least this many seconds of answers (and every prompt once), from
    # the moment every user has had one answer, so that a pass is not a window of under a
    # second: on one H200 the 135M target's batch of 80 took under a second a round and its rate
    # moved by 12% (sd) from one pass to the next, the draft's (2-3 s) by 10-22%; five such passes
    # left each ratio a 95% interval of about ±20%. 0 = every prompt once.
    speed_pass_s: float = 5.0
    # After the stage's own timing, each server's speed measured again on the same warm server by
    # other code (stages/evaluate/speed_check.py: another client, warm-up and count); the
    # summary gives both ratios and says whether they agree within 10%. Costs the same time as
    # the timing again.
    speed_check: bool = False
    # How the two servers the speed ratio compares are timed (SpeedServers above): on one H200 a
    # server's rate moved by up to 40% from one pass to the next within a minute, with either
    # client, so a ratio of servers timed minutes apart carries that.
    speed_servers: SpeedServers = SpeedServers.auto
    # Closed-loop streams at which the speed ratio is also measured, e.g. [1, 4, 16, 64, 128]:
    # at each level that many users share the first set's prompts, each sending its next
    # request when its last is answered; per-stream and aggregate tokens/s of both servers, the
    # gain with its interval, and the crossover where it falls below 1 (the draft's KV cache
    # costs concurrency). [] = concurrency 1 and the batch only. Needs speed repeats.
    concurrency: list[int] = field(default_factory=list)
    # Seconds allowed for generating all prompts on one vLLM server (start-up not included).
    timeout_s: int = 1800
    # A served draft whose acceptance length's 95% interval lies at or below this on any prompt
    # set fails the run: a trained draft near 1.0 is a fault (the attention backend, the capture
    # ids, the vocabulary mapping, a target other than the one trained on), not a figure.
    # null: no floor.
    acceptance_floor: float | None = 1.05
    # fail: the floor and the identity check fail the run (exit 1, the MLflow run FAILED with the
    # reason as its `failure` tag; publish takes finished runs only). warn: research runs go on,
    # the summary's first line saying which gate failed.
    gates: Gates = Gates.fail
    # A proven mismatch's prompt is served again alone on a fresh draft server (a server start,
    # only when one is found). Following the target's path there, it is transient: the engine's
    # fault under one batch, not the run's settings. fail: it fails the run as a reproduced one
    # does; warn: the summary says so and the run goes on. null: fail on a GPU (the serving
    # stack the draft ships on), warn on a CPU, where vLLM's CPU build (0.32.0) served one wrong
    # token in 240 outputs in some runs of the default and not in seven passes after
    # (docs/troubleshooting.md).
    transient_mismatches: Gates | None = None

    def resolve(self, cfg: RunnerConfig) -> None:
        """A draft trained elsewhere is evaluated alone (training one here would be ignored);
        data.hold_out, when null, keeps the held-out set's room where it is served."""
        if self.draft and cfg.run.stages == [ALL_STAGES]:
            cfg.run.stages = ["evaluate"]
        if cfg.data.hold_out is None:
            serves = "heldout" in self.prompts and not self.draft
            cfg.data.hold_out = HELD_OUT_ROOM if serves else 0

    def check(self) -> None:
        for key in (
            "num_prompts",
            "max_new_tokens",
            "num_speculative_tokens",
            "timeout_s",
            "speed_prompts",
            "choose_epoch_prompts",
        ):
            at_least(f"eval.{key}", getattr(self, key), 1)
        if self.num_speculative_tokens > SPECULATIVE_TOKENS_MAX:
            raise ConfigError(
                "eval.num_speculative_tokens",
                f"{self.num_speculative_tokens} is more than {SPECULATIVE_TOKENS_MAX}: vLLM's "
                "config takes any positive k and a large one fails only once the target has "
                "loaded, while an EAGLE-3 draft's acceptance is near zero after a few positions",
            )
        if self.acceptance_floor is not None:
            within(
                "eval.acceptance_floor", self.acceptance_floor, 1.0, 1.0 + SPECULATIVE_TOKENS_MAX
            )
            best = 1 + self.num_speculative_tokens  # every drafted token accepted, every step
            if self.acceptance_floor >= best:
                raise ConfigError(
                    "eval.acceptance_floor",
                    f"{self.acceptance_floor} can never be passed: with "
                    f"eval.num_speculative_tokens={self.num_speculative_tokens} the acceptance "
                    f"length is at most {best}; lower the floor or raise k",
                )
        if self.speed_repeats is not None:
            at_least("eval.speed_repeats", self.speed_repeats, 0)
        at_least("eval.speed_pass_s", self.speed_pass_s, 0)
        levels = list(self.concurrency)
        if levels != sorted(set(levels)) or any(n < 1 or n > CONCURRENCY_MAX for n in levels):
            raise ConfigError(
                "eval.concurrency",
                f"{levels}: give ascending, distinct levels from 1 to {CONCURRENCY_MAX}, e.g. "
                "[1,4,16,64,128]",
            )
        if levels and self.speed_repeats == 0:
            raise ConfigError(
                "eval.concurrency",
                f"{levels} asks for speed at each level, but eval.speed_repeats=0 times nothing; "
                "set eval.speed_repeats (e.g. 3)",
            )
        above("eval.near_tie_gap", self.near_tie_gap, 0)
        names = [prompt_set_name(p) for p in self.prompts]
        if not names or len(set(names)) != len(names):
            raise ConfigError(
                "eval.prompts",
                f"{list(self.prompts)}: give at least one prompt set, each once (names {names})",
            )
        if self.max_model_len < self.max_new_tokens + 1:
            raise ConfigError(
                "eval.max_model_len",
                f"{self.max_model_len} leaves no room for a prompt and eval.max_new_tokens="
                f"{self.max_new_tokens}",
            )
