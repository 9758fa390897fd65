"""`zeroplan models`: the model catalogue with exact parameter counts."""

from __future__ import annotations

import click

from zeroplan.report.common import FORMATS


@click.command("models")
@click.option("--format", "output_format", type=click.Choice(FORMATS), default="table", show_default=True, help="Output format.")
def command(output_format: str) -> None:
    """List the models MODEL can name, with their exact parameter counts (as Hugging Face
    transformers instantiates them).

    \b
    Examples:
      zeroplan models
      zeroplan models --format json
    """
    from zeroplan.importers.catalog import list_models
    from zeroplan.estimate.serialize import model_rows
    from zeroplan.report.estimate import render_models

    click.echo(render_models(model_rows(list_models()), output_format), nl=False)
