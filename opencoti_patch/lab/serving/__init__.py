"""llama-server with sparse attention: the load test (:mod:`.loadtest` and its parts) and the passkey set
served one request at a time against several at a time (:mod:`.passkey`)."""
