from django.apps import AppConfig


class DemoConfig(AppConfig):
    name = "example_project.demo"
    label = "demo"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from example_project.demo import tracing

        tracing.configure()
