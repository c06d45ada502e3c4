"""/openapi.json: what each route takes and answers, as the server does it."""
