"""The front end over HTTP: the OpenAI routes, the operator routes, the streamed relay."""
