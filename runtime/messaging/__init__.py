"""Kafka as every service speaks it: the typed bus (producer, batch consumer, dead letters), topic creation,
and the memory of recently handled keys that makes retried batches safe."""
