"""rollstream.producers: everything that writes rollout events. The harness SDK:

from rollstream.producers import Recorder, RecorderSettings
with Recorder(RecorderSettings()) as recorder:
    with recorder.rollout(task_id="t", group_id="g") as r:
        r.llm_call(prompt_ids, completion_ids, logprobs)
"""

from rollstream.producers.sdk.context import ContextError, ContextMatch, ContextTrie, ProducerError
from rollstream.producers.sdk.delivery import Delivery, DeliveryStats
from rollstream.producers.sdk.recorder import (
    Recorder,
    RecorderError,
    RecorderSettings,
    RecorderUsageError,
    RolloutHandle,
    kafka_producer_options,
)
from rollstream.producers.sdk.spool import Spool, SpoolError
from rollstream.producers.sdk.transport import (
    DeliveryError,
    KafkaTransport,
    MemoryTransport,
    Transport,
)

__all__ = [
    "ContextError",
    "ContextMatch",
    "ContextTrie",
    "Delivery",
    "DeliveryError",
    "DeliveryStats",
    "KafkaTransport",
    "MemoryTransport",
    "ProducerError",
    "Recorder",
    "RecorderError",
    "RecorderSettings",
    "RecorderUsageError",
    "RolloutHandle",
    "Spool",
    "SpoolError",
    "Transport",
    "kafka_producer_options",
]
