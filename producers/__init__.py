"""rollstream.producers: everything that writes rollout events. The harness SDK:

from rollstream.producers import Recorder, RecorderSettings
with Recorder(RecorderSettings()) as recorder:
    with recorder.rollout(task_id="t", group_id="g") as r:
        r.llm_call(prompt_ids, completion_ids, logprobs)

Every error of the package derives from ProducerError (the tree: rollstream.producers.errors).
The recording proxy (rollstream.producers.proxy) is the ``proxy`` extra; importing this package
does not import it.
"""

from rollstream.producers.errors import (
    ContextError,
    ProducerError,
    RecorderError,
    RecorderUsageError,
    SpoolError,
)
from rollstream.producers.sdk.context import ContextMatch, ContextTrie
from rollstream.producers.sdk.delivery import Delivery, DeliveryStats
from rollstream.producers.sdk.recorder import Recorder, RolloutHandle
from rollstream.producers.sdk.settings import RecorderSettings, kafka_producer_options
from rollstream.producers.sdk.spool import Spool
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
