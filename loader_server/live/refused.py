"""What a put refuses of a sample: the field that is wrong and why (the producer's other samples go on)."""


class Refused(Exception):
    """A sample the job cannot take: `field` names what is wrong, the message why."""

    def __init__(self, field_name: str, reason: str):
        super().__init__(reason)
        self.field = field_name
