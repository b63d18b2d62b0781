"""The agent worker role (`role`), its agent loops (`loops`, `openai_agent`) and the tools they call (`tools`)."""
