"""rollmesh's built-in inference engine: an HTTP server with SGLang's API (`server`,
`weight_routes`, `bodies`, `api`, `openai_api` with `openai_requests` and `openai_responses`)
over a continuous-batching scheduler (`scheduler`, `kvcache`, `sampling`)."""
