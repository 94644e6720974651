"""One source's draft length: `FixedLength(k)`, and `AdaptiveLength`, the k that maximises expected
tokens per second at this context, chosen each step from what is learned of the source's drafts
(`estimates.Learned`) as it bears on the request at hand (`Outlook`). The contract these keep is
`policy.LengthPolicy`; the reasoning and the measured figures: docs/policy.md.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping, Sequence

from localspec.outputs import StepRecord
from localspec.speculative.costs import START as COST_START, expected_tokens_by_place
from localspec.speculative.estimates import GREEDY, MAX_RETRY_WAIT, BatchPrice, Learned, Regime
from localspec.speculative.plan import NO_DRAFT, DraftPlan, Offer, SharedPass, plain_plan


class FixedLength:
    """Always draft `k` tokens (fewer near max_tokens or the end of the context): prompt lookup's
    where it found some, else the draft model's (`plan.plain_plan`)."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError("draft length must be >= 0")
        self.k = k

    def plan(self, offer: Offer, limit: int, context: int = 0, shared: SharedPass | None = None) -> DraftPlan:
        return plain_plan(offer, min(self.k, limit))

    def observe(self, step: StepRecord) -> None:
        pass  # learns nothing

    def fork(self, regime: "Regime | None" = None) -> "FixedLength":
        return self  # no state of its own

    @property
    def idle(self) -> bool:
        return self.k == 0

    def explain(self) -> str | None:
        return "a fixed draft length of 0" if self.k == 0 else None

    def describe(self) -> str:
        return f"{self.k} (FixedLength)"


class Outlook:
    """What is learned of a source's drafts (`Learned`) as it bears on one request, and what a draft
    of each length is worth there: the request's sampling regime and that regime's `Estimates`, the
    match its next draft extends, its text's failures against what the estimates predicted, the
    price of its pass when other sequences share it. From these: E(k) and T(k), the tokens per
    second of each k and the best k (`rates`, `best_length`), whether any k could pay (`can_pay`),
    whether the regime is judged idle (`idle`); and the regime's evidence as draft tokens are
    judged (`judge`), with its probe budget and re-tries."""

    def __init__(self, learned: Learned, *, k_max: int = 16, min_gain: float = 0.10, keep_gain: float = 0.05,
                 min_trials: int = 8, probe_length: int = 2, probe_budget: float = 0.01, retry_weight: float = 4.0,
                 text_weight: float | None = None) -> None:
        self.learned = learned  # shared by every request's fork
        # the terms a length is judged on
        self.k_max = k_max
        self.min_gain = min_gain  # predicted speedup over k = 0 below which drafting is not worth it
        self.keep_gain = keep_gain  # the same for going on drafting (at most min_gain)
        self.min_trials = min_trials  # draft tokens judged before the policy may give up on drafting
        self.probe_length = probe_length  # the length of a draft made for evidence
        self.probe_budget = probe_budget  # most of the time spent that probes may take
        self.retry_weight = retry_weight  # on a re-try, the costs' history counts as this many steps
        # this text's own failures against what the estimates predicted for the same tokens: a
        # text fails g = (w + failed) / (w + predicted) times as often as they say (w: text_weight
        # tokens' worth of belief in the estimates; None: no per-text correction)
        self.text_weight = text_weight
        # the request at hand
        self.regime = GREEDY  # how it samples
        self.est = learned.of(GREEDY)  # ... and what is known of that
        self.run = 0  # the match the next draft extends: a draft model's tokens accepted in a row; a lookup's, given
        self._text_failed = self._text_predicted = 0.0
        self.price: BatchPrice | None = None  # set for a step whose pass other sequences share
        self.context = 0  # the context length of the last step asked about
        self.hopeless = False  # this request's last recheck found that no acceptance would pay
        self.retry_wanted = False  # a probe was fully accepted: re-try drafting on the whole text
        self.resync = False  # the draft must catch up on everything before the next proposal

    def fork(self) -> "Outlook":
        """The outlook of one more request on the same regime: nothing of this one's text."""
        twin = copy.copy(self)
        twin.run, twin.context = 0, 0
        twin.retry_wanted = twin.resync = twin.hopeless = False
        twin._text_failed = twin._text_predicted = 0.0
        twin.price = None
        return twin

    def start(self, regime: Regime | None = None) -> None:
        """A new request begins, sampling as `regime` says (None: greedy): it is priced with that
        regime's estimates, and teaches them alone. An idle regime that pays in the long run
        re-tries drafting on it, as its probe budget or its wait between re-tries allows."""
        regime = GREEDY if regime is None else regime
        if regime != self.regime:  # what the last steps said was of another regime
            self.regime, self.est = regime, self.learned.of(regime)
            self.retry_wanted = False
        self.run = 0  # nothing drafted yet for this text
        self._text_failed = self._text_predicted = 0.0
        self.hopeless = False
        self.est.since_retry += 1
        if not self.idle or not (self.budget_left() or self.est.since_retry >= self.est.retry_wait):
            return
        # with the draft's cost at the lower of the fitted one and the prior guess: an idle policy
        # stops measuring the draft (a probe drafts from a window, at another rate), so a cost fitted
        # while the machine was busy would otherwise keep it idle for good, in later processes too
        rate = self.rates(self.k_max, acceptance=self.est.long_acceptance, optimistic=True)  # [K+1]
        if max(rate[1:], default=0.0) >= (1.0 + self.min_gain) * rate[0]:
            self.begin_retry()  # it pays in the long run: judge min_trials draft tokens on this prompt

    # -- what each length yields and takes

    def expected_tokens(self, k: int) -> float:
        """E(k): the tokens a step drafting k yields, the oracle's own included."""
        return float(self._expected_tokens(k)[k])

    def step_time(self, k: int, context: int | None = None) -> float:
        """T(k): the seconds a step drafting k takes."""
        return float(self._step_times(k, self.context if context is None else context)[k])

    def _expected_tokens(self, k_top: int, acceptance: float | None = None) -> list[float]:
        """E(k) for k = 0..k_top [k_top+1]: each draft token at its place's acceptance after a step
        like the last one (`acceptance` given: that one for every token)."""
        ahead = ([acceptance] * k_top if acceptance is not None
                 else self.in_this_text(self.est.by_place.ahead(k_top, self.run)))  # [k_top]
        return expected_tokens_by_place(ahead, self.est.continuation_accepted)

    def in_this_text(self, acceptance: Sequence[float]) -> list[float]:
        """Acceptance estimates [m] corrected for the text at hand: each failure probability times
        the text's failure ratio so far (see `text_weight`). The estimates follow every text
        alike; texts differ: a copy's lookups hold where an edit's, on matches as long, do not
        (on the bench, the first token 84-100% of the time on copy, grounded and long prompts,
        33% on a code edit)."""
        if self.text_weight is None:
            return list(acceptance)
        ratio = (self.text_weight + self._text_failed) / (self.text_weight + self._text_predicted)
        return [min(1.0, max(0.0, 1.0 - (1.0 - float(a)) * ratio)) for a in acceptance]

    def _evaluated(self, lengths: Sequence[float]) -> list[float]:
        """Tokens the draft evaluates to propose each of `lengths` [m] (the draft cost's size)."""
        if not self.learned.model_draft:
            return [1.0] * len(lengths)
        catch_up = self.learned.catch_up
        return [max(1.0, float(n) - 1.0 + catch_up) for n in lengths]

    def draft_times(self, lengths: Sequence[float], context: int, *, optimistic: bool = False) -> list[float]:
        """Seconds for the draft to propose each of `lengths` [m] tokens at `context` [m].
        `optimistic`: the lower of the fitted cost and the prior guess."""
        sizes = self._evaluated(lengths)  # [m]
        if self.price is not None:
            if not self.learned.model_draft:
                return [0.0] * len(sizes)  # a lookup: nothing to decode
            return self.price.draft_times(lengths, sizes)
        return self.learned.draft_times_alone(sizes, context, optimistic=optimistic)

    def _step_times(self, k_top: int, context: int, *, optimistic: bool = False) -> list[float]:
        """T(k) for k = 0..k_top [k_top+1] at `context`: a draft of length l (of k) costs its
        proposal and a pass of l + 1 tokens; it runs to l with P(L >= l) = c^(l-1), c the
        draft's continuation."""
        passes = range(1, k_top + 2)  # [K+1] passes of 1..K+1 tokens
        verify = (self.learned.verify_cost.times(passes, context) if self.price is None
                  else self.price.verify_times(passes))  # [K+1]
        drafts = self.draft_times(range(1, k_top + 1), context, optimistic=optimistic)  # [K]
        c = self.est.continuation
        out, stopped, at_least = [verify[0]], 0.0, 1.0  # drafts ending before l (their cost), P(L >= l)
        for proposal, verify_pass in zip(drafts, verify[1:]):
            cost = proposal + verify_pass
            out.append(stopped + at_least * cost)
            stopped += at_least * (1.0 - c) * cost
            at_least *= c
        return out

    def rates(self, limit: int, context: int | None = None, *, acceptance: float | None = None,
              optimistic: bool = False) -> list[float]:
        """Expected tokens per second for k = 0..min(limit, k_max) [K+1] (needs a measured pass), at
        the running acceptance or the one given (`optimistic`: see draft_times). In Python floats,
        as every quantity it is made of: a policy asks at every recheck and for every offer it
        sizes, and on arrays of a few to 65 lengths numpy's cost per call was most of the time."""
        k_top = min(limit, self.k_max)
        expected = self._expected_tokens(k_top, acceptance)
        times = self._step_times(k_top, self.context if context is None else context, optimistic=optimistic)
        return [e / t for e, t in zip(expected, times)]

    # -- what pays

    def can_pay(self, limit: int, context: int | None = None, *, optimistic: bool = False) -> bool:
        """Whether drafting could beat the oracle alone by `min_gain` at all: were every draft token
        accepted, at the costs measured (the prior guess where the draft's is not; `optimistic`: see
        draft_times). Where it could not (a draft that costs as much as its oracle: the default pair
        on a GPU), no acceptance evidence can change that, so nothing is drafted to gather it: no
        first trials, no probes, no re-tries (a re-try, begun at a new request, prices the draft
        optimistically, so a cost measured on a busy machine does not keep it idle for good). True
        before a pass was measured."""
        if limit <= 0:
            return False
        if not self.learned.verify_cost.ready or self.price is not None:
            # NOTE: in a pass other sequences share, a draft's price depends on how many of them draft
            # (`BatchPrice.drafting`), which only drafting teaches: gated, requests four at a time
            # drafted by prompt lookup stopped drafting together and ran 8% slower
            return True
        # a draft cost from fewer than START proposals may be one caught in a stall: the guess bounds it
        settled = not self.learned.model_draft or self.learned.draft_cost.observations >= COST_START
        rate = self.rates(limit, context, acceptance=1.0, optimistic=optimistic or not settled)  # [K+1]
        return max(rate[1:], default=0.0) >= (1.0 + self.min_gain) * rate[0]

    def best_length(self, limit: int, context: int | None = None, *, optimistic: bool = False) -> int:
        """The k (0..limit) that promises the most tokens per second, if it beats the oracle alone by
        the gain drafting needs (`keep_gain` while the regime drafts, else `min_gain`); else 0."""
        if not self.learned.verify_cost.ready:
            return min(self.probe_length, limit)  # nothing measured yet: try a short draft
        rate = self.rates(limit, context, optimistic=optimistic)  # [K+1]
        k = rate.index(max(rate))  # the shortest k on a tie
        gain = self.keep_gain if self.est.drafting else self.min_gain  # drafting goes on more easily than it starts
        return k if rate[k] >= (1.0 + gain) * rate[0] else 0

    @property
    def idle(self) -> bool:
        """Whether the regime is judged not to pay: no k beats the oracle alone after `min_trials`
        draft tokens judged, or none could whatever the acceptance."""
        if not self.learned.verify_cost.ready or self.best_length(self.k_max, optimistic=self.est.exploring) > 0:
            return False
        return self.est.fresh_trials >= self.min_trials or not self.can_pay(self.k_max, optimistic=self.est.exploring)

    # -- evidence

    def judge(self, trials: int, n_accepted: int, run: int) -> None:
        """Learn from `trials` draft tokens of a step whose first one extended a match `run` tokens
        long (see `AcceptanceByPlace.key`), the first `n_accepted` accepted."""
        if trials <= 0:  # (an idle step: nothing to learn, and a re-try is judged once its trials are in)
            return
        if self.text_weight is not None:
            self._text_predicted += sum(1.0 - a for a in self.est.by_place.ahead(trials, run))
            self._text_failed += float(trials - n_accepted)
        self.learned.judge(self.est, trials, n_accepted, run)
        if self.est.fresh_trials >= self.min_trials and self.est.exploring:  # the re-try is judged
            self.est.exploring = False
            # found paying: the next idle stretch may re-try at the next request; not: wait twice as long
            paid = self.best_length(self.k_max) > 0
            self.est.retry_wait = 1 if paid else min(2 * self.est.retry_wait, MAX_RETRY_WAIT)

    def score_unverified(self, matched: int, compared: int, *, run: int | None = None) -> None:
        """A draft this source offered but did not draft (the other source of a hybrid did), scored
        against the tokens the step emitted: its first `compared` tokens were compared, the first
        `matched` of them agreed. Its acceptance counts as a drafted step's would (nothing was
        spent): a source that is not chosen still learns what the text is like now, so estimates
        kept from other texts (a lookup's from prompts that did not repeat) cannot keep it unchosen
        where it would pay, nor chosen where it would not. `run`: the match the offer's first token
        extended when it was made (default: the one this source's next draft extends)."""
        if compared <= 0:
            return
        run = self.run if run is None else run
        self.run = run + matched if matched == compared else 0
        self.judge(matched + (matched < compared), matched, run)

    def budget_left(self) -> bool:
        """Whether the regime's probes took no more than `probe_budget` of its time."""
        return self.est.probe_time <= self.probe_budget * self.est.time_spent

    def begin_retry(self) -> None:
        """Judge drafting afresh: min_trials new draft tokens, on costs the re-try measures (not
        the ones that made the policy idle): the draft's history is dropped (its scale too: the
        re-try's first proposals set it anew), the oracle's counts as only `retry_weight` steps
        (its one-token passes went on being measured meanwhile)."""
        self.est.fresh_trials = self.est.since_retry = 0
        self.est.exploring = True
        self.learned.draft_cost.restart()
        self.learned.verify_cost.soften(self.retry_weight)

    def take_resync(self) -> bool:
        """Whether the draft must catch up on all of the text before its next proposal (asked once)."""
        wanted, self.resync = self.resync, False
        return wanted


class AdaptiveLength:
    """Cost-aware draft length (see the module docstring): each step, the best k at what is learned
    (`Outlook.best_length`), drafting nothing unless that beats the oracle alone by `min_gain`; and
    drafts made for evidence: short ones until `min_trials` draft tokens are judged, a probe every
    `probe_every` idle steps within the probe budget, a re-try after a fully accepted probe. While
    idle, k is judged afresh every `recheck_every` steps only (a draft model's up to `recheck_max`
    apart once `recheck_patience` rechecks in a row found that no acceptance would pay)."""

    def __init__(self, *, k_max: int = 16, prior_acceptance: float = 0.9, prior_continuation: float = 1.0,
                 prior_weight: float = 4.0, draft_cost_ratio: float = 0.5, model_draft: bool = True,
                 decay: float = 0.97, probe_every: int = 16, probe_budget: float = 0.01, probe_length: int = 2,
                 min_trials: int = 8, min_gain: float = 0.10, keep_gain: float = 0.05,
                 long_decay: float = 0.995, probe_bank: float = 30.0, runs: Sequence[int] | None = None,
                 place_priors: Sequence[float] | None = None, text_weight: float | None = None,
                 name: str | None = None) -> None:
        self.name = name or ("draft model" if model_draft else "prompt lookup")  # the source, for people
        # what is learned, shared by every request's fork
        self.learned = Learned(prior_acceptance=prior_acceptance, prior_continuation=prior_continuation, runs=runs,
                               place_priors=place_priors, prior_weight=prior_weight, decay=decay,
                               long_decay=long_decay, draft_cost_ratio=draft_cost_ratio, model_draft=model_draft)
        # ... as it bears on the request at hand
        self.outlook = Outlook(self.learned, k_max=k_max, min_gain=min_gain, keep_gain=keep_gain,
                               min_trials=min_trials, probe_length=probe_length, probe_budget=probe_budget,
                               text_weight=text_weight)
        self.probe_every = probe_every  # idle (k = 0) steps before a probe
        self.probe_bank = probe_bank  # seconds of steps whose unused probe budget carries over
        self.recheck_every = 8  # while idle, judge k afresh every this many steps ...
        self.recheck_max = 64  # ... or up to this many apart where no acceptance would pay (see draft_length)
        self.recheck_patience = 8  # ... once this many rechecks in a row found so
        # the length last chosen, and whether it drafts for evidence rather than because drafting pays
        self.last_k = 0
        self.probing = False  # ... a probe's
        self.for_evidence = False  # ... a probe's, a re-try's or one of a regime's first (`min_trials`)

    # what is learned (see Learned), and of the running regime (see Outlook)
    verify_cost = property(lambda self: self.learned.verify_cost,
                           lambda self, cost: setattr(self.learned, "verify_cost", cost))
    draft_cost = property(lambda self: self.learned.draft_cost)
    est = property(lambda self: self.outlook.est)
    min_trials = property(lambda self: self.outlook.min_trials)

    def fork(self, regime: Regime | None = None) -> "AdaptiveLength":
        """The policy of one more request running beside others: the same learned state (costs,
        estimates) and settings, a request state of its own (the match it is on, its text's
        failures, a probe or re-try under way), started on `regime` when given."""
        twin = copy.copy(self)
        twin.outlook = self.outlook.fork()
        twin.last_k = 0
        twin.probing = twin.for_evidence = False
        if regime is not None:
            twin.outlook.start(regime)
        return twin

    def plan(self, offer: Offer, limit: int, context: int = 0, shared: SharedPass | None = None) -> DraftPlan:
        """The best length now (`draft_length`), drafted by the plain rule (`plan.plain_plan`)."""
        shared_price = self.learned.batch_price(shared.contexts, context, shared.drafting) if shared is not None else None
        self.outlook.price = shared_price
        k = self.draft_length(limit, context)
        if k <= 0:
            return NO_DRAFT
        return dataclasses.replace(plain_plan(offer, k), resync=self.outlook.take_resync(), probe=self.probing)

    @property
    def idle(self) -> bool:
        return self.outlook.idle

    def draft_length(self, limit: int, context: int = 0, *, offered: int | None = None,
                     run: int | None = None) -> int:
        """`offered`: the tokens the proposer has on offer, when it knows them before the length is
        chosen (a lookup's match). Unlike `limit` (the generation's end, the context's), a short
        offer that does not pay is a judgement on the source, and counts toward its idleness.
        `run`: the length of the match the offer extends (`Draft.match_length`)."""
        out, est = self.outlook, self.outlook.est
        self.probing = False
        if run is not None:
            out.run = run
        out.context = context
        available = limit if offered is None else min(limit, offered)
        if available <= 0:
            return 0
        if out.retry_wanted:  # at once, while the text is easy; its cost delays the next probes
            out.retry_wanted = False
            if out.can_pay(available):
                out.begin_retry()  # judge min_trials draft tokens afresh, on the whole text
                out.resync = True
        # idle, k is judged afresh every recheck_every steps: meanwhile only the oracle's cost moved
        # (a step that rests costs next to nothing: an idle step's host time is the oracle alone's)
        interval = min(self.recheck_every << max(0, est.rechecks + 1 - self.recheck_patience), self.recheck_max)
        resting = est.idle_steps % interval and (est.fresh_trials >= out.min_trials or out.hopeless)
        # a re-try drafts at the length the prior guess of the draft's cost would choose, so what it
        # measures is the cost of the drafts the policy would go on with
        k = 0 if resting else out.best_length(available, optimistic=est.exploring)
        hopeless = None  # judged at this step (a recheck's), else None
        if k == 0 and not resting and est.idle_steps and self.learned.model_draft:
            # a recheck that found nothing: where no acceptance would pay either (a draft as dear as
            # its oracle: the default pair on a GPU), only the costs can change that, slowly (with
            # the context): after recheck_patience such rechecks (not a passing stall: a busy
            # machine's timings idled a paying draft for a few of them), each waits twice as long
            # as the last, up to recheck_max steps
            hopeless = self._judge_hopeless(available)
            est.rechecks = min(est.rechecks + 1, 32) if hopeless else 0
        if k > 0:
            est.idle_steps = est.rechecks = 0
        elif resting:
            k = self._idle_step(available)
        elif est.fresh_trials < out.min_trials and not (hopeless if hopeless is not None
                                                         else self._judge_hopeless(available)):
            k = min(out.probe_length, available)  # one or two early rejections are not evidence enough
        elif not self._near_the_end(limit):
            k = self._idle_step(available)
        self.last_k = k
        est.drafting = k > 0
        self.for_evidence = k > 0 and (self.probing or est.exploring or est.fresh_trials < out.min_trials)
        return k

    def _judge_hopeless(self, available: int) -> bool:
        """Whether no acceptance could make drafting pay here (`can_pay`): then this request's
        idle steps rest between rechecks as a judged regime's do."""
        self.outlook.hopeless = not self.outlook.can_pay(available, optimistic=self.outlook.est.exploring)
        return self.outlook.hopeless

    def _near_the_end(self, limit: int) -> bool:
        """Too few tokens left for a draft to pay (the generation's end), where a longer one would:
        not a sign of an idle pair."""
        return limit < self.outlook.k_max and self.outlook.best_length(self.outlook.k_max) > 0

    def _idle_step(self, available: int) -> int:
        """k for a step where no draft pays: 0, or a probe's short draft every `probe_every` such
        steps while the probe budget allows."""
        out = self.outlook
        out.est.idle_steps += 1
        out.est.since_probe += 1
        if out.est.since_probe < self.probe_every or not out.budget_left():
            return 0
        out.est.since_probe = 0
        if out.hopeless or not out.can_pay(available):
            return 0  # no acceptance a probe could find would pay (as the last recheck found)
        self.probing = True
        return min(out.probe_length, available)

    def observe(self, step: StepRecord) -> None:
        out, est = self.outlook, self.outlook.est
        n_drafted, n_accepted = step.drafted, step.accepted
        spent = step.draft_time + step.verify_time
        est.time_spent += spent
        if step.batch_seqs <= 1:  # a shared pass is observed once, for the batch (observe_pass)
            self.learned.observe_step(step)
        if self.probing or est.exploring:  # exploring's price: beyond the oracle alone's time for its tokens
            est.probe_time += max(0.0, spent - (n_accepted + 1) * self.learned.verify_cost(1, step.context))
        est.cap_probe_bank(out.probe_budget, self.probe_bank)
        run, out.run = out.run, out.run + n_accepted if 0 < n_drafted == n_accepted else 0
        if self.probing:  # drafted from a window of the text: a biased sample, only a hint
            out.retry_wanted, out.run = out.run > 0, 0
            return
        out.judge(n_accepted + (n_accepted < n_drafted), n_accepted, run)
        if n_drafted:
            self.learned.observe_continuation(est, n_drafted, n_accepted, allowance=max(self.last_k, n_drafted))

    def explain(self, source: str = "the draft") -> str | None:
        """Why this policy drafts nothing now, for people: what the running regime's estimates
        predict at the best draft length against the gain drafting needs (None before a pass
        was measured)."""
        out = self.outlook
        if not self.learned.verify_cost.ready or out.k_max < 1:
            return None
        rate = out.rates(out.k_max)  # [K+1]
        k = 1 + rate[1:].index(max(rate[1:]))
        need = 1.0 + (out.keep_gain if out.est.drafting else out.min_gain)
        costs = f"an oracle pass {1000 * self.learned.verify_cost(1, out.context):.0f} ms"
        if self.learned.model_draft:
            one, nine = out.draft_times([1, 9], out.context)
            costs += f", a draft token {1000 * (nine - one) / 8:.0f} ms"
        return (f"{source}'s estimated acceptance {out.est.acceptance:.0%} ({out.regime.describe()}; {costs}) "
                f"predicts {rate[k] / rate[0]:.2f}x the oracle alone at best (k={k}); drafting needs {need:.2f}x")

    def known_regimes(self) -> list[dict[str, Any]]:
        """What is known of each regime met (here or in earlier processes), for people (`localspec
        check`): its acceptance, the draft tokens judged, and whether it drafts now (if not, why)."""
        out = self.outlook
        own = out.regime, out.est
        found = []
        try:
            for regime, est in self.learned.estimates.items():
                out.regime, out.est = regime, est
                idle = self.idle
                found.append({"source": self.name,
                              "regime": regime.describe(), "acceptance": round(est.acceptance, 3),
                              "trials": est.trials, "drafting": not idle, "why_idle": self.explain() if idle else None})
        finally:
            out.regime, out.est = own
        return found

    def describe(self) -> str:
        k_max = self.outlook.k_max
        return f"AdaptiveLength (chosen per step{f', up to {k_max}' if k_max else ''})"

    # -- what is learned: the costs of the passes the engine measures, kept between processes (see Learned)

    def observe_pass(self, passes: Sequence[tuple[Sequence[int], Sequence[int]]], seconds: float) -> None:
        self.learned.observe_pass(passes, seconds)

    def observe_draft_round(self, passes: Sequence[tuple[Sequence[int], Sequence[int]]], seconds: float) -> None:
        self.learned.observe_draft_round(passes, seconds)

    def decode_time(self, passes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> float | None:
        return self.learned.decode_time(passes)

    def observe_draft(self, evaluated: int, context: int, seconds: float) -> None:
        self.learned.observe_draft(evaluated, context, seconds)

    def needs_costs(self) -> tuple[bool, bool]:
        return self.learned.needs_costs()

    def cost_state(self) -> dict[str, dict[str, Any]]:
        return self.learned.cost_state()

    def load_cost_state(self, kind: str, state: Mapping[str, Any]) -> None:
        self.learned.load_cost_state(kind, state, min_trials=self.outlook.min_trials,
                                     probe_budget=self.outlook.probe_budget, probe_bank=self.probe_bank)
        if kind == "acceptance":
            self.outlook.est = self.learned.of(self.outlook.regime)
