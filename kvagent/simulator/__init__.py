"""A simulated vLLM engine (``kvagent serve --simulate`` and the tests): the events it makes and the ZMQ
publisher and replay socket that send them."""
