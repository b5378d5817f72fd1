"""Where commands run: the connector interface (run, put, get), SSH and local connectors, trust."""
