"""rollstream.adapters: thin I/O adapters over the contract that every room shares:

topics      the Kafka topic manager (create and describe the contract's topics)
codecs      build_codec(settings): the Codec every deployable builds from its settings
registry    ConfluentRegistry: confluent-kafka's Schema Registry client behind the
            contract's SchemaRegistry protocol (the ``registry`` extra)
metrics     ServiceMetrics, serve_metrics, metrics_routes: Prometheus /metrics and the
            /livez, /readyz probes of every service (prometheus_client: the ``cli`` extra)
"""
