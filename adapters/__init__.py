"""rollstream.adapters: thin I/O adapters over the contract that every room shares: the Kafka
topic manager (create and describe the contract's topics)."""
