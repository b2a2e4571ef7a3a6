"""What a node may say when it does not release: one of a few fixed texts.

Errors and refusals are replies too. A text computed from anything on the node (an exception's
name or message, a number, a path, a file's line) can carry a bit about the records, so the
server only ever gets a rule's fixed text; the detail goes to the node's own log. Every error
reply passes ``public_reason``, which turns any text outside this set into ``FAILED``.
"""

from __future__ import annotations

from common import records as R
from common.secagg.protocol import FORGED, INCONSISTENT, MALFORMED, REPLAYED, UNTRUSTED

FAILED = "failed on the node (see the node's log); a reserved release stays spent"
REQUEST = "request: invalid (see the node's log)"
DATA = "data: unreadable on this node"
NODE = "node: not ready (see the node's log)"
BAD_WEIGHTS = "refused: bad weights"

# policy rules (``fedsyn_client.policy``): the reply says which one refused, and nothing else
RULE_COLUMNS = "columns not allowed"
RULE_EPSILON = "epsilon above the node's budget"
RULE_VOCABULARY = "vocabulary not allowed"
RULE_DELTA = "delta not allowed"
RULE_CAP = "phase cap"
RULE_PHASE = "phase not for this node"
RULE_MODEL = "model not allowed"
RULE_EMBEDDER = "embedder not allowed"
RULE_FINETUNE = "finetune not allowed"
RULE_MAX_LENGTH = "max-length above the node's cap"
RULE_VOTE_WINDOW = "vote window not the node's"
RULE_VOTE_PRECISION = "vote precision not the node's"
RULE_CANDIDATES = "candidates above the node's cap"
RULE_STEPS = "local-steps above the node's cap"
RULE_BATCH = "batch-size above the node's cap"
RULE_ROUNDS = "rounds above the node's cap"
RULE_CELLS = "marginal cells above the node's cap"
RULE_OPEN_ROUNDS = "open masked rounds above the node's cap"
RULES = (RULE_COLUMNS, RULE_EPSILON, RULE_VOCABULARY, RULE_DELTA, RULE_CAP, RULE_PHASE, RULE_MODEL, RULE_EMBEDDER,
         RULE_FINETUNE, RULE_MAX_LENGTH, RULE_VOTE_WINDOW, RULE_VOTE_PRECISION, RULE_CANDIDATES, RULE_STEPS, RULE_BATCH,
         RULE_ROUNDS, RULE_CELLS, RULE_OPEN_ROUNDS)

# secure aggregation's refusals (facts of the round's messages and the node's trust, never of the records)
SECAGG_REASONS = (MALFORMED, UNTRUSTED, FORGED, INCONSISTENT, REPLAYED)

# budget rules (facts of the ledger, never of the records)
BUDGET = "budget"
BUDGET_PHASE = "budget: phase"
BUDGET_CAP = "budget: phase cap"
BUDGET_ROUND = "budget: round released before"
BUDGET_STEPS = "budget: steps"
BUDGET_BOUND = "budget: reservation bound to other terms"
BUDGET_REPLAYED = "budget: released before for another request"


class Refusal(Exception):
    """A request the node does not serve; ``reply`` is the fixed text the server gets, the
    message the detail for the node's log."""

    code = R.ERR_CONFIG
    prefix = ""

    def __init__(self, rule: str, detail: str = "") -> None:
        super().__init__(detail or rule)
        self.rule = rule

    @property
    def reply(self) -> str:
        """The fixed text of the error reply."""
        return f"{self.prefix}{self.rule}"


class BudgetExceeded(Refusal):
    """A release the ledger refuses (budget, a phase's share, a cap, a round or step bound)."""

    code = R.ERR_BUDGET
    prefix = "refused: "


class BadWeights(Refusal):
    """Incoming weights that are not finite, absurdly large, or not this model's."""

    code = R.ERR_WEIGHTS

    def __init__(self, detail: str) -> None:
        super().__init__(BAD_WEIGHTS, detail)


class NodeSetupError(Refusal):
    """The node's own configuration, ledger or data is unusable (the detail says what to fix)."""

    def __init__(self, detail: str, reply: str = NODE) -> None:
        super().__init__(reply, detail)


class SecAggRefusal(Refusal):
    """A secure-aggregation step this node will not take (``common.secagg.protocol``'s fixed
    texts: too few trusted sites, a forged key, survivors it did not see, a replayed step)."""

    code = R.ERR_POLICY
    prefix = "refused: "


def public_reason(text: str) -> str:
    """``text`` if it is one of the fixed replies, else ``FAILED``: a guard, so that a new
    refusal with a computed text can never reach the server."""
    return text if text in FIXED_REPLIES else FAILED


FIXED_REPLIES = frozenset({FAILED, REQUEST, DATA, NODE, BAD_WEIGHTS}
                          | {f"refused: {r}" for r in (BUDGET, BUDGET_PHASE, BUDGET_CAP, BUDGET_ROUND, BUDGET_STEPS,
                                                       BUDGET_BOUND, BUDGET_REPLAYED)}
                          | {f"refused: policy: {r}" for r in RULES}
                          | {f"refused: {r}" for r in SECAGG_REASONS})
