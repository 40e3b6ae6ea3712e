from moezero.models.gpt import GPTModel, language_model_loss
from moezero.models.sampling import generate

__all__ = ["GPTModel", "language_model_loss", "generate"]
