"""dspark.export"""
