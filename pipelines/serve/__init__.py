"""`distill serve`: the teacher on its inference mesh behind HTTP, for students elsewhere.

`server` loads the teacher and serves it; `scorer` runs batches of rows through it;
`batcher` gathers concurrent requests into those batches; `app` has the routes and
`apis` the JSON formats of the APIs (OpenAI/vLLM completions, SGLang); `teacher.wire` the
binary top-k format it shares with distill's own client (`teacher.endpoint`).
"""
