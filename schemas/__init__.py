"""turnstream's contract: event structs, codec and topic specs. Imports nothing else of turnstream's."""

from schemas.codec import DecodeError, decode, decode_any, encode
from schemas.events import (
    FINISH_REASONS as FINISH_REASONS_ALLOWED,
)
from schemas.events import (
    SCHEMA_VERSION,
    ContractError,
    DeadLetter,
    Event,
    FunctionCall,
    Judgment,
    Message,
    PairedTurn,
    Sample,
    SamplingParams,
    TeacherScores,
    ToolCall,
    Turn,
    Vote,
    WeightsPublished,
)
from schemas.topics import ALL_TOPICS, TopicSpec, normalize_namespace, spec_for, topic_name

__all__ = [
    "ALL_TOPICS",
    "FINISH_REASONS_ALLOWED",
    "SCHEMA_VERSION",
    "ContractError",
    "DeadLetter",
    "DecodeError",
    "Event",
    "FunctionCall",
    "Judgment",
    "Message",
    "PairedTurn",
    "Sample",
    "SamplingParams",
    "TeacherScores",
    "ToolCall",
    "TopicSpec",
    "Turn",
    "Vote",
    "WeightsPublished",
    "decode",
    "decode_any",
    "encode",
    "normalize_namespace",
    "spec_for",
    "topic_name",
]
