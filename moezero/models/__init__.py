from moezero.models.gpt import GPTModel, language_model_loss

__all__ = ["GPTModel", "language_model_loss"]
