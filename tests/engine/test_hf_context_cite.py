"""ContextCite on engine.hf: our sentence partitioner (no nltk data), the K3 prompt layout, and the
needle of a short builtin:demo find-fact prompt ranked first among the context's sentences."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("context_cite")

import engine.hf as hf  # noqa: E402
from engine.errors import InputError  # noqa: E402
from engine.hf.context_cite import K3ContextCiter, SentencePartitioner, k3_layout  # noqa: E402
from engine.session import Session  # noqa: E402
from workbench.task_templates import append_task, fact_task  # noqa: E402
from workbench.text import haystack  # noqa: E402

VALUE = "3-8-2-5"


def test_partitioner_rebuilds_the_context() -> None:
    text = 'First one. Second "two." Third?\n\nFourth line\nfifth!  sixth'
    p = SentencePartitioner(text)
    assert p.sources == ["First one.", 'Second "two."', "Third?", "Fourth line", "fifth!", "sixth"]
    assert p.get_context() == text
    assert p.get_context(np.array([0, 1, 0, 1, 1, 0], bool)) == 'Second "two."\n\nFourth line\nfifth!'
    with pytest.raises(InputError, match="6 entries"):
        p.get_context(np.ones(3, bool))


def test_needle_ranks_first() -> None:
    model = hf.K3ForCausalLM.from_pretrained("builtin:demo")
    tokenizer = hf.K3Tokenizer.from_pretrained("builtin:demo")
    plain = tokenizer.engine_tokenizer
    task = fact_task([("report.txt", haystack(500, plain, seed=3))], "greenhouse alarm", VALUE, depth=0.5,
                     restate=False)
    context = task.documents[0][1]
    layout = k3_layout(plain, system=task.system, question=task.question, response_prefix=task.prefix)
    scratch = Session(model.engine_model, plain)  # the layout is the session's (nothing runs)
    append_task(scratch, task)
    scratch.append(ids=plain.chat_prompt([], add_generation_prompt=True) + plain.response_prefix(task.prefix))
    assert layout(context) == scratch.tokens
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ContextCite's CUDA autocast on a CPU
        citer = K3ContextCiter(model, tokenizer, context, task.question, layout=layout, num_ablations=32,
                               generate_kwargs={"max_new_tokens": 10, "do_sample": False,
                                                "eos_token_id": [plain.end_of_msg_id, plain.close_id]})
        assert citer.response.startswith(VALUE)
        scores = citer.get_attributions(start_idx=0, end_idx=len(VALUE), verbose=False)
    assert scores.shape == (citer.num_sources,) and citer.num_sources > 5
    top = int(np.argmax(scores))
    assert citer.sources[top] == f"The code that opens the greenhouse alarm is {VALUE}."
    assert scores[top] > 1.0 and np.sort(scores)[-2] < scores[top] / 4
