"""Wire formats: each turns its API's history into a neutral `Conversation`
and turns a `Plan` back into a body of the same API."""
