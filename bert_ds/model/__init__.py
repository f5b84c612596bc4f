"""Single-device BERT (never imports deepspeed): parameters carry Hugging Face ``BertForPreTraining`` names."""

from bert_ds.model.bert import KERNEL_CHOICES, BertForPreTraining, BertModel, PretrainingOutput

__all__ = ["BertForPreTraining", "BertModel", "PretrainingOutput", "KERNEL_CHOICES"]
