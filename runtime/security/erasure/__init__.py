"""Erasure by destroying keys (crypto-shredding): how turnstream forgets a person on an append-only log.

Kafka cannot delete one session's records from the middle of a partition, and compaction would need every record
keyed by its own id (losing the per-session partition order the pairer relies on) and still only erases some time
after a tombstone. So each session's records are sealed with a key of their own (AES-256-GCM, ``envelope.py``),
kept in Redis (``keys.py``); forgetting a session deletes its key, and every copy of its records, in every topic,
namespace, dead letter and backup of the log, becomes noise at once. What a key cannot reach (the console's
projection, the pairer's open turn, the spool, weights already trained) ``turnstream forget`` deletes or states.
"""
