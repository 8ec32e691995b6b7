"""`icml soup`: Self-Soupervision — SSL ingredients (MAE, MoCo v3, MMCR, LeJEPA) cooked on shifted
unlabelled images from one stock, souped, and fine-tuned back (arXiv 2602.02890)."""
from icml.cli.method import HIGHER, LOWER, Method

METHOD = Method(
    name="soup",
    package=__name__,
    title="Self-Soupervision: Cooking Model Soups without Labels",
    arxiv="2602.02890",
    status="complete",
    result="not at this scale",
    summary="Self-supervised ingredients cooked on shifted images, souped and fine-tuned back; corruption benchmark.",
    config="SoupConfig",
    tags={"benchmark": "string", "shift": "string", "corruption": "string", "severity": "string",
          "algo": "string", "ingredient": "string", "order": "string", "ssl_pool": "string", "stage": "string",
          "pair": "string"},
    metrics={"clean_acc": HIGHER, "corruption_acc": HIGHER, "mce": LOWER, "gain_vs_stock": HIGHER,
             "val_acc": HIGHER, "knn_acc": HIGHER, "ssl_loss": LOWER, "ft_loss": LOWER, "soup_weight": None,
             "task_vector_cos": None, "dist_from_stock": None, "interp_barrier": LOWER, "wall_s": LOWER},
    variants=("stock_ft", "best_single_ingredient", "self_soup_uniform", "self_soup_greedy", "self_soup_then_ft",
              "self_season_soup", "soup_clean_ssl", "supervised_soup_uniform", "supervised_soup_greedy",
              "ensemble"),
    presets=("real",),
    preset_times={"smoke": "≈ 53 s train+eval+report", "default": "≈ 11.3 min train+eval",
                  "real": "≈ 14.5 min train+eval, one core", "paper": "GPU-sized; not timed"},
)
