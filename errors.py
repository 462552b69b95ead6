"""Error codes and the base error class of omlx-jobs.

A leaf module: it imports nothing of ours, so every layer (the store and the client included) may use it
without pulling anything else in. The codes' values are what users see in stored rows and output files.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Every typed error code omlx-jobs stores or prints. A member equals its value (`"invalid_json"`)."""

    # The input line is wrong (submit-time validation): retrying will not help.
    INVALID_REQUEST = "invalid_request"
    INVALID_ENCODING = "invalid_encoding"
    LINE_TOO_LONG = "line_too_long"
    INVALID_JSON = "invalid_json"
    DUPLICATE_KEY = "duplicate_key"
    INVALID_TYPE = "invalid_type"
    MISSING_FIELD = "missing_field"
    EMPTY_VALUE = "empty_value"
    OUT_OF_RANGE = "out_of_range"
    TOO_LONG = "too_long"
    INVALID_VALUE = "invalid_value"
    UNKNOWN_FIELD = "unknown_field"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    UNSUPPORTED_METHOD = "unsupported_method"
    UNSUPPORTED_URL = "unsupported_url"
    ENDPOINT_MISMATCH = "endpoint_mismatch"
    CONFLICTING_FIELDS = "conflicting_fields"
    INVALID_ROLE = "invalid_role"
    UNSUPPORTED_CONTENT = "unsupported_content"
    UNSUPPORTED_SCHEMA = "unsupported_schema"
    INVALID_SCHEMA = "invalid_schema"
    DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
    EMPTY_FILE = "empty_file"
    # image_url parts (jobs/images.py)
    INVALID_IMAGE_URL = "invalid_image_url"
    INVALID_IMAGE = "invalid_image"
    IMAGE_TOO_LARGE = "image_too_large"
    IMAGE_NOT_FOUND = "image_not_found"
    IMAGE_PATH_NOT_ALLOWED = "image_path_not_allowed"
    REMOTE_IMAGES_DISABLED = "remote_images_disabled"
    IMAGE_HOST_NOT_ALLOWED = "image_host_not_allowed"
    IMAGE_REJECTED_BY_PROCESSOR = "image_rejected_by_processor"
    """The model's image processor refuses its size (an aspect ratio over 200 for Qwen2-VL), at submit or run."""
    # The request cannot run on the worker's model (found at run time): permanent too.
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_PROMPT = "invalid_prompt"
    NO_CHAT_TEMPLATE = "no_chat_template"
    CHAT_TEMPLATE_ERROR = "chat_template_error"
    # Embeddings (worker/embeddings/): a request of the other kind than the model, or dimensions it cannot give.
    NOT_AN_EMBEDDING_MODEL = "not_an_embedding_model"
    EMBEDDING_MODEL_ONLY = "embedding_model_only"
    DIMENSIONS_NOT_SUPPORTED = "dimensions_not_supported"
    # An image that decodes badly or cannot be fetched at run time (worker/images.py), or a text-only model.
    TRUNCATED_IMAGE = "truncated_image"
    IMAGE_TOO_MANY_PIXELS = "image_too_many_pixels"
    IMAGE_UNREACHABLE = "image_unreachable"
    IMAGES_NOT_SUPPORTED = "images_not_supported"
    # A request's grammar or logit_bias cannot be built for the worker's model (worker/grammar.py, logits.py).
    GRAMMAR_ERROR = "grammar_error"
    INVALID_LOGIT_BIAS = "invalid_logit_bias"
    # A request with tools for a model whose template has no tool-call markup we parse (worker/tools/).
    TOOLS_NOT_SUPPORTED = "tools_not_supported"
    # Failures of ours (the engine, a lost worker): retrying can help.
    SERVER_ERROR = "server_error"
    ENGINE_ERROR = "engine_error"
    TOO_MANY_ATTEMPTS = "too_many_attempts"
    WORKER_LOST = "worker_lost"
    TIMEOUT = "timeout"
    SHARD_FAILED = "shard_failed"
    """Its shard failed before starting any request, too often (worker/shard.py)."""
    UNSTORABLE_RESULT = "unstorable_result"
    """The database refused the result's data (store/db.py)."""
    # Output lines of requests that never ran because their job was cancelled.
    BATCH_CANCELLED = "batch_cancelled"
    # Requests of an API batch whose completion window passed before they ran (store/batches.py).
    BATCH_EXPIRED = "batch_expired"

    def __str__(self) -> str:  # the value, as users see it (not "ErrorCode.X")
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class FinishReason(str, Enum):
    """Why a choice stopped, as OpenAI's `finish_reason` says it. A member equals its value (`"stop"`)."""

    STOP = "stop"
    """An end-of-sequence token or a stop string."""
    LENGTH = "length"
    """max_tokens, or the model's context, reached."""
    TOOL_CALLS = "tool_calls"
    """The answer is tool calls (set where they are parsed from the output, worker/reasoning/plan.py)."""
    EMBEDDED = "embedded"
    """An embeddings request: its vectors were computed (no text was generated)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# Codes a bad image reference can carry (at submit, or per request in the worker: jobs/images.py).
IMAGE_SOURCE_CODES = frozenset(
    {
        ErrorCode.INVALID_IMAGE_URL,
        ErrorCode.INVALID_IMAGE,
        ErrorCode.IMAGE_TOO_LARGE,
        ErrorCode.IMAGE_NOT_FOUND,
        ErrorCode.IMAGE_PATH_NOT_ALLOWED,
        ErrorCode.REMOTE_IMAGES_DISABLED,
        ErrorCode.IMAGE_HOST_NOT_ALLOWED,
        ErrorCode.IMAGE_REJECTED_BY_PROCESSOR,
    }
)

# Codes an input line can get at submit: the line is wrong.
INPUT_ERROR_CODES = frozenset(
    {
        ErrorCode.INVALID_REQUEST,
        ErrorCode.INVALID_ENCODING,
        ErrorCode.LINE_TOO_LONG,
        ErrorCode.INVALID_JSON,
        ErrorCode.DUPLICATE_KEY,
        ErrorCode.INVALID_TYPE,
        ErrorCode.MISSING_FIELD,
        ErrorCode.EMPTY_VALUE,
        ErrorCode.OUT_OF_RANGE,
        ErrorCode.TOO_LONG,
        ErrorCode.INVALID_VALUE,
        ErrorCode.UNKNOWN_FIELD,
        ErrorCode.UNSUPPORTED_PARAMETER,
        ErrorCode.UNSUPPORTED_METHOD,
        ErrorCode.UNSUPPORTED_URL,
        ErrorCode.ENDPOINT_MISMATCH,
        ErrorCode.CONFLICTING_FIELDS,
        ErrorCode.INVALID_ROLE,
        ErrorCode.UNSUPPORTED_CONTENT,
        ErrorCode.UNSUPPORTED_SCHEMA,
        ErrorCode.INVALID_SCHEMA,
        ErrorCode.DUPLICATE_CUSTOM_ID,
        ErrorCode.EMPTY_FILE,
        *IMAGE_SOURCE_CODES,
        ErrorCode.DIMENSIONS_NOT_SUPPORTED,  # at submit when --model is a local embedding model (else at run time)
    }
)

# Failures of ours: output lines report them as 500s, and `retry` runs them again. Every other code means
# the request itself is wrong, reported as a 400 as OpenAI does.
SERVER_ERROR_CODES = frozenset(
    {
        ErrorCode.SERVER_ERROR,
        ErrorCode.ENGINE_ERROR,
        ErrorCode.TOO_MANY_ATTEMPTS,
        ErrorCode.WORKER_LOST,
        ErrorCode.TIMEOUT,
        ErrorCode.SHARD_FAILED,
        ErrorCode.UNSTORABLE_RESULT,
    }
)


class OmlxError(Exception):
    """Base of every error omlx-jobs raises on purpose. Its message says what went wrong and what to do.

    `code` is set on errors that are stored or shown with a typed code (a request's failure, a bad line).
    """

    code: ErrorCode | None = None
