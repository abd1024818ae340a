"""Chat requests with images to a LLaVA server (in process: Starlette's TestClient over the app, the
llava-tiny engine on a thread): a data: URL image gives transformers' greedy tokens, and the same
image as PNG or as lossless WebP is one cached image; bad image input is a 400 that names the
problem or the limit, decided without stalling the requests beside it."""

from __future__ import annotations

import base64
import io
import json
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from starlette.testclient import TestClient

from kvtier.engine.client import EngineClient
from kvtier.engine.core import EngineCore
from kvtier.model.tokenizer import IMAGE_TOKEN_ID
from kvtier.serve.api import Server
from kvtier.serve.media import MediaPolicy

MAX_TOKENS = 8
BS = 8
MAX_BYTES = 1_000_000


def picture(seed: int, size=(40, 52)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def data_url(image: Image.Image, fmt: str = "PNG", **save) -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def chat(*parts: dict | str, **extra) -> dict:
    content = [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]
    return {
        "model": "llava",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    } | extra


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def llava(checkpoint):
    return checkpoint("llava-tiny")


@pytest.fixture(scope="module")
def client(llava):
    core = EngineCore(
        llava, max_model_len=256, num_device_blocks=64, block_size=BS, max_images_per_request=2, max_image_bytes=MAX_BYTES
    )
    engine = EngineClient.in_thread(core, max_queue=64)
    server = Server(engine, "llava", media=MediaPolicy(frozenset({"images.example"})))
    with TestClient(server.app) as c:
        c.engine = engine
        yield c
    server.close()
    engine.shutdown()


def post(client, body: dict | bytes):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post("/v1/chat/completions", content=data, headers={"Content-Type": "application/json"})


def refused(r, *words: str) -> str:
    assert r.status_code == 400, r.text[:500]
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message
    return message


def test_a_data_url_image_gives_transformers_tokens(client, llava):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    image = picture(1)
    r = post(client, chat("describe ", image_part(data_url(image)), " in a few words"))
    assert r.status_code == 200, r.text[:500]
    got = r.json()["choices"][0]["token_ids"]
    processor = AutoProcessor.from_pretrained(llava)
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "describe <image> in a few words"}], tokenize=False, add_generation_prompt=True
    )
    inputs = processor(text=text, images=[image], return_tensors="pt")
    model = LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32).eval()
    with torch.no_grad():
        seq = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    assert got == seq[0, inputs["input_ids"].shape[1] :].tolist()
    assert r.json()["choices"][0]["prompt_token_ids"] == inputs["input_ids"][0].tolist()


def test_two_images_side_by_side_give_transformers_tokens(client, llava):
    """Two image parts with no text between them ("compare these"): one placeholder each, as the
    processor expands ``<image><image>``."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    a, b = picture(5), picture(6)
    r = post(client, chat("compare ", image_part(data_url(a)), image_part(data_url(b)), " please"))
    assert r.status_code == 200, r.text[:500]
    processor = AutoProcessor.from_pretrained(llava)
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "compare <image><image> please"}], tokenize=False, add_generation_prompt=True
    )
    inputs = processor(text=text, images=[a, b], return_tensors="pt")
    model = LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32).eval()
    with torch.no_grad():
        seq = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    assert r.json()["choices"][0]["prompt_token_ids"] == inputs["input_ids"][0].tolist()
    assert r.json()["choices"][0]["token_ids"] == seq[0, inputs["input_ids"].shape[1] :].tolist()
    swapped = post(client, chat("compare ", image_part(data_url(b)), image_part(data_url(a)), " please"))
    assert swapped.json()["usage"]["prompt_tokens_details"]["cached_tokens"] < inputs["input_ids"].shape[1] // 2


def test_the_same_pixels_as_png_or_lossless_webp_are_one_cached_image(client):
    image = picture(2)
    prefix = "a question asked of a picture: "
    first = post(client, chat(prefix, image_part(data_url(image)), ". answer in one line"))
    again = post(client, chat(prefix, image_part(data_url(image, "WEBP", lossless=True)), ". answer in one line"))
    other = post(client, chat(prefix, image_part(data_url(picture(3))), ". answer in one line"))
    ids = first.json()["choices"][0]["prompt_token_ids"]
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, again, other)]
    assert cached[1] == (len(ids) - 1) // BS * BS
    # another image behind the same text: the blocks before the image's first block only
    image_at = ids.index(IMAGE_TOKEN_ID)
    assert image_at == 1 + len("user\n" + prefix) and cached[2] == image_at // BS * BS
    assert again.json()["choices"][0]["token_ids"] == first.json()["choices"][0]["token_ids"]


def test_a_placeholder_typed_by_the_client_is_text_not_an_image(client):
    r = post(client, chat("what is <image>? "))  # the tokenizer's special token, as plain text
    assert r.status_code == 200, r.text[:500]
    assert IMAGE_TOKEN_ID not in r.json()["choices"][0]["prompt_token_ids"]


def _bomb() -> str:
    buf = io.BytesIO()
    Image.new("L", (20_000, 20_000)).save(buf, format="PNG")  # ~400 KB of zeros deflated: 400M pixels
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize(
    "part, words",
    [
        (image_part("data:image/png;base64,iVBORw0KGgo*not-base64*"), ("image 0", "not valid base64")),
        (image_part("data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nbroken").decode()), ("not a PNG",)),
        (image_part("data:image/gif;base64,R0lGODlh"), ("image/gif", "image/png")),
        (image_part("data:image/png,rawbytes"), ("data:<type>;base64,<data>",)),
        (image_part("http://169.254.169.254/latest/meta-data"), ("--allowed-media-domains", "169.254.169.254")),
        (image_part("file:///etc/passwd"), ("scheme 'file'",)),
        (image_part("http://[::1/x.png"), ("image 0", "not a URL")),
        ({"type": "image_url", "image_url": "data:image/png;base64,AAAA"}, ("image_url content part",)),
        ({"type": "audio", "audio": "x"}, ("text or image_url",)),
    ],
)
def test_bad_image_input_is_a_400_naming_it(client, part, words):
    refused(post(client, chat("look: ", part)), *words)


def test_a_long_thin_image_is_refused_before_it_is_resized(client):
    """1024 x 4 pixels, 92 bytes of PNG, within every limit: resized to the tower's shortest edge it
    would be 336 x 86,016 pixels in the serving process."""
    thin = data_url(Image.new("RGB", (1024, 4)))
    refused(post(client, chat("look: ", image_part(thin))), "1024x4", "aspect ratio over 200:1")
    ok = post(client, chat("look: ", image_part(data_url(picture(3, size=(400, 2))))))  # 200:1 is served
    assert ok.status_code == 200, ok.text[:300]


def test_a_decompression_bomb_is_refused_from_its_header(client):
    refused(post(client, chat("look: ", image_part(_bomb()))), "400000000 pixels", "--max-image-pixels")


def test_more_images_than_the_limit_are_refused_before_any_is_read(client):
    parts = [image_part("data:image/png;base64,broken!")] * 3  # never decoded: the count refuses first
    refused(post(client, chat(*parts)), "3 images in one request", "--max-images-per-request")


def test_a_hundred_thousand_parts_are_refused_and_do_not_stall_others(client):
    many = json.dumps(chat(*[image_part("data:,")] * 100_000)).encode()
    result: dict = {}

    def other() -> None:
        result["r"] = post(client, chat("hello ", image_part(data_url(picture(4)))))

    t = threading.Thread(target=other)
    t.start()
    refused(post(client, many), "100000 images in one request")
    t.join(timeout=120)
    assert result["r"].status_code == 200


def test_a_completion_prompt_with_a_placeholder_and_no_image_is_refused(client):
    r = client.post("/v1/completions", json={"model": "llava", "prompt": "a <image> b", "max_tokens": 1})
    refused(r, "1 image placeholders but 0 images")


@pytest.fixture(scope="module")
def media_host():
    """An HTTP server on 127.0.0.1: /ok.png (an image), /big (over MAX_BYTES), /hop (a redirect)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    buf = io.BytesIO()
    picture(5).save(buf, format="PNG")
    pages = {"/ok.png": buf.getvalue(), "/big": b"\0" * (MAX_BYTES + 10)}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/hop":
                self.send_response(302)
                self.send_header("Location", "http://169.254.169.254/")
                self.end_headers()
                return
            body = pages.get(self.path, b"")
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_allowed_media_domains_are_fetched_within_the_limits(client, media_host):
    server = Server(client.engine, "llava", media=MediaPolicy(frozenset({"127.0.0.1"})))
    with TestClient(server.app) as fetching:
        fetched = post(fetching, chat("describe ", image_part(f"{media_host}/ok.png"), " in a few words"))
        inline = post(client, chat("describe ", image_part(data_url(picture(5))), " in a few words"))
        assert fetched.status_code == 200, fetched.text[:500]
        assert fetched.json()["choices"][0]["token_ids"] == inline.json()["choices"][0]["token_ids"]
        refused(post(fetching, chat(image_part(f"{media_host}/big"))), "--max-image-bytes")
        refused(post(fetching, chat(image_part(f"{media_host}/hop"))), "redirects (302)", "not followed")
        refused(post(fetching, chat(image_part(f"{media_host}/missing"))), "fetching", "failed")
    server.close()
    # the module's server names another host: this one's URLs are refused, never fetched
    refused(post(client, chat(image_part(f"{media_host}/ok.png"))), "'127.0.0.1'", "--allowed-media-domains")


def test_tokenize_counts_each_image_as_its_placeholder_tokens(client):
    body = {"model": "llava", "messages": chat("describe ", image_part(data_url(picture(1))), " now")["messages"]}
    counted = client.post("/tokenize", json=body)
    assert counted.status_code == 200, counted.text[:500]
    served = post(client, chat("describe ", image_part(data_url(picture(1))), " now", max_tokens=1))
    assert counted.json()["tokens"] == served.json()["choices"][0]["prompt_token_ids"]


_URLS = st.one_of(
    st.text(max_size=40).map(lambda t: "data:image/png;base64," + t),
    st.binary(max_size=64).map(lambda b: "data:image/png;base64," + base64.b64encode(b).decode()),
    st.binary(max_size=64).map(lambda b: "data:image/webp;base64," + base64.b64encode(b"RIFF" + b).decode()),
    st.sampled_from(["", "data:", "data:,", "http://", "https://[::1", "ftp://x/y", "data:image/png;base64,===="]),
    st.text(max_size=30),
)
_PARTS = st.one_of(
    st.builds(lambda u: image_part(u), _URLS),
    st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=20)),
    st.dictionaries(st.sampled_from(["type", "image_url", "text", "url"]), st.one_of(st.text(max_size=8), st.none()), max_size=3),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(_PARTS, min_size=1, max_size=4))
def test_fuzzed_image_parts_get_an_answer_or_a_4xx(client, parts):
    r = post(client, chat(*parts, max_tokens=1))
    assert r.status_code in (200, 400, 422), r.text[:500]
