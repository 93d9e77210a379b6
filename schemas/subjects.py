"""Every NATS subject moebus uses (DESIGN §2), in one place.

Public subjects (`llm.*`) are the client API; everything else is internal.
Subjects with variable parts are built by the functions below so that no module
formats a subject string by hand.
"""

GENERATE = "llm.generate"
MODELS = "llm.models"
CANCEL = "llm.cancel"
TOKENIZE = "llm.tokenize"
DETOKENIZE = "llm.detokenize"

SUBMIT = "sched.submit"

CTL_CANCEL = "ctl.cancel"
HEARTBEAT_PREFIX = "ctl.heartbeat"
HEARTBEAT_ALL = "ctl.heartbeat.>"

# Queue groups: replicas of one stateless service share the work of a subject.
GATEWAY_QUEUE = "gateway"
SCHEDULER_QUEUE = "scheduler"


def prefill_task(instance: str) -> str:
    return f"prefill.{instance}.task"


def decode_reserve(instance: str, rank: int) -> str:
    return f"decode.{instance}.{rank}.reserve"


def decode_start(instance: str, rank: int) -> str:
    return f"decode.{instance}.{rank}.start"


def tokens(gateway: str, request_id: str) -> str:
    return f"tok.{gateway}.{request_id}"


def tokens_all(gateway: str) -> str:
    """Wildcard a gateway subscribes to once for the token streams of all its requests."""
    return f"tok.{gateway}.*"


def heartbeat(role: str, instance: str, rank: int = 0) -> str:
    return f"{HEARTBEAT_PREFIX}.{role}.{instance}.{rank}"
