from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=200)
    placed_at = models.DateTimeField(auto_now_add=True)
