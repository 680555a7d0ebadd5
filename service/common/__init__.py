"""What both sides of the app need, below both: the error answers, the metrics registry, the
state every route reads, the text type requests carry. Imports neither service/http/ nor
service/analysis/ (tests/model/test_layering.py); service/app.py assembles the two above it."""
