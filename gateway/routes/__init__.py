"""The OpenAI API routes the gateway serves, and the handlers that run admission, relay and finish
for each."""
