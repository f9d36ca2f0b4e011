"""The API routes as values (:mod:`gateway.admission.route`): :data:`API_ROUTES`, admitted and
forwarded upstream (:func:`gateway.routes.handlers.handle_completion`), and :data:`TOKEN_ROUTES`,
answered from the model's counter (:func:`gateway.routes.tokenize_handlers.handle_tokenize`)."""

from gateway.routes.chat import CHAT
from gateway.routes.completions import COMPLETIONS
from gateway.routes.embeddings import EMBEDDINGS
from gateway.routes.responses import RESPONSES
from gateway.routes.tokenize import DETOKENIZE, TOKENIZE

API_ROUTES = (CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS)
TOKEN_ROUTES = (TOKENIZE, DETOKENIZE)
