"""rollmesh's built-in inference engine: an HTTP server with SGLang's API (`server`, `api`, `openai_api`) over a continuous-batching scheduler (`scheduler`, `kvcache`, `sampling`)."""
