"""`dspark bench`: acceptance, single-stream speed against peer runtimes, and a load sweep.

subjects      what is benchmarked: the pair's folders, the cached export, prompts, the stop token
acceptance    accepted length and position-wise acceptance of the drafters (reference decoder)
timeline      per-token timestamps of one generation -> tokens/s, first-token and per-token latency
peers         Hugging Face transformers and onnxruntime-genai on the same target checkpoint; also
              onnxruntime-genai's draft-model speculation with `dspark train draft-model`'s draft model
single_stream every system on the same prompts, one request at a time, checked against greedy
load_sweep    concurrent requests through the batched runtime: throughput vs per-user speed
plots, report PNG figures and markdown tables of the results JSON
"""
