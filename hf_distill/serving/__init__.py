"""Teachers behind a URL (issue #42): the wire formats (`protocol`: vLLM's completions with `prompt_logprobs`,
SGLang's native `/generate`, this package's server), the client (`client`: detection, checks, retries), the
trainer's teacher source (`source`: the server's top-k + tail in the offline signal's form, prefetched) and the
package's own server (`server`, `hf-distill teacher serve`)."""

from .client import TeacherClient, is_teacher_url
from .protocol import PROTOCOLS, MalformedAnswer, RowScores

__all__ = ["PROTOCOLS", "MalformedAnswer", "RowScores", "TeacherClient", "is_teacher_url"]
