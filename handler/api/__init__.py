"""The API surface: request parsing and answer building, native and OpenAI side by side.

- `handler.api.native`: the native contract of `POST /predictions/{model}`.
- `handler.api.openai`: the OpenAI-compatible routes (requests, answers, tools).
- `handler.api.entry`: one TorchServe request entry -> what serves it, and the
  `Answer` interface both doors implement for the schedules in `handler.serving`.

The field names and rules that need neither torch nor a model live in `handler.schema`.
"""
